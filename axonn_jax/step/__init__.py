"""The model-agnostic core: `StackedModel`, gradient reducers, the update and `make_train_step`."""
from .model import ModelFunctions, StackedModel
from .reducers import GradientReducer, compressed_mean, exact_mean
from .train_step import StepOptions, TrainStep, make_train_step

__all__ = ["GradientReducer", "ModelFunctions", "StackedModel", "StepOptions", "TrainStep",
           "compressed_mean", "exact_mean", "make_train_step"]
