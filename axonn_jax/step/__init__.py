"""The model-agnostic core: `StackedModel`, gradient engines and reducers, the optax update, the
typed `TrainState` and `make_train_step`."""
from .engines import PipelineEngine, SpmdEngine
from .model import ModelFunctions, StackedModel
from .reducers import GradientReducer, compressed_mean, exact_mean
from .state import TrainState
from .train_step import StepOptions, TrainStep, make_train_step

__all__ = ["GradientReducer", "ModelFunctions", "PipelineEngine", "SpmdEngine", "StackedModel",
           "StepOptions", "TrainState", "TrainStep", "compressed_mean", "exact_mean",
           "make_train_step"]
