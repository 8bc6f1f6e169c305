"""`axonn_jax.train`: the training entry points, `train(options, model=None, data=None)` and
`TrainOptions` (the loop and its hooks live in `axonn_jax.run`)."""
from .run.loop import train
from .run.options import TrainOptions, make_optimizer
from .run.trainer import Trainer, build_trainer

__all__ = ["TrainOptions", "Trainer", "build_trainer", "make_optimizer", "train"]
