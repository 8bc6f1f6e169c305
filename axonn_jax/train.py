"""`axonn_jax.train`: the training entry points, `train(config, model=None, data=None)`, the config
tree `RunConfig` and `TrainOptions(**flat names)` that builds one (the loop and its hooks live in
`axonn_jax.run`)."""
from .run.loop import train
from .run.options import RunConfig, TrainOptions, make_optimizer
from .run.trainer import Trainer, build_trainer

__all__ = ["RunConfig", "TrainOptions", "Trainer", "build_trainer", "make_optimizer", "train"]
