"""axonn_jax: hybrid data × pipeline × 2D/3D tensor parallelism for JAX, with compressed gradients
(CGX) and host-memory offload of optimizer state and activations (AxoNN, KARMA)."""
from .config import AXES, ParallelConfig
from .mesh import make_mesh, simulate_cpu_devices
from . import layers
from .transform import parallelize

__all__ = ["AXES", "ParallelConfig", "layers", "make_mesh", "parallelize", "simulate_cpu_devices"]
__version__ = "0.1.0"
