"""axonn_jax: hybrid data × pipeline × 2D/3D tensor parallelism for JAX, with compressed gradients
(CGX) and host-memory offload of optimizer state and activations (AxoNN, KARMA)."""
from .config import AXES, ParallelConfig
from .mesh import make_mesh, simulate_cpu_devices
from .parallel.pipeline_module import pipeline
from .run.distributed import init_distributed
from .step import GradientReducer, StackedModel, TrainState, TrainStep, make_train_step
from .tp import layers, layers_nnx
from .tp.options import KernelOptions
from .tp.parallelize import parallelize
from .tp.report import SplitReport
from .tp.rules import AsDense, Replicated

__all__ = ["AXES", "AsDense", "GradientReducer", "KernelOptions", "ParallelConfig", "StackedModel",
           "TrainState", "TrainStep",
           "init_distributed", "layers", "layers_nnx", "make_mesh", "make_train_step",
           "parallelize", "pipeline", "Replicated", "simulate_cpu_devices", "SplitReport"]
__version__ = "0.1.0"
