"""axonn_jax: hybrid data × pipeline × 2D/3D tensor parallelism for JAX, with compressed gradients
(CGX) and host-memory offload of optimizer state and activations (AxoNN, KARMA)."""
from .config import AXES, ParallelConfig
from .distributed import init_distributed
from .mesh import make_mesh, simulate_cpu_devices
from . import layers
from .parallel.pipeline_module import pipeline
from .transform import parallelize

__all__ = ["AXES", "ParallelConfig", "init_distributed", "layers", "make_mesh", "parallelize",
           "pipeline", "simulate_cpu_devices"]
__version__ = "0.1.0"
