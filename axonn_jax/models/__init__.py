"""The built-in models, as presets the command line names (`--model`): each builds a `StackedModel`
and says what data it trains on and how its dimensions must divide over a grid. A Hugging Face
directory (`--init-from`) is a preset too (`pretrained(path)`), whose parameters start from the
checkpoint's."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable

from ..config import ParallelConfig
from ..step.model import StackedModel


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named model: how to build it, the data it trains on and the checkpoint it starts from.

    Attributes:
      name: the preset's name (`--model`), or the Hugging Face directory of `pretrained`.
      config: its shape (with `check_grid(grid)` and, for language models, `max_seq_len`,
        `vocab_size`).
      build: `build(dtype, grid=None) -> StackedModel` (the grid it will run on, which may change
        how a layer is laid out).
      network: `network(dtype, grid=None)`: the same model as one linen module
        `tokens (b, t) -> logits (b, t, vocab)` with the same parameters (for sampling and
        export; None for image models).
      data: the batches it trains on (`tokens`: language-model batches `{'inputs', 'targets'}`
        of `(batch, seq_len)` int32; `images`: the config's `example_batch(batch_size)` and
        `batches(seed, batch_size)`, drawn procedurally).
      checkpoint: the Hugging Face directory its parameters start from (None: a fresh
        initialization).
      family: the architecture's Hugging Face mapping (`models.hf.Family`).
      module: the model's module (`models.gpt`, `models.llama`): `stacked`, `network`.
    """

    name: str
    config: Any
    build: Callable[..., StackedModel]
    network: Callable[..., Any] | None = None
    data: str = "tokens"
    checkpoint: str | None = None
    family: Any = None  # the architecture's Hugging Face mapping (`models.hf.Family`)
    module: Any = None  # the model's module (`models.gpt`, `models.llama`): `stacked`, `network`

    def check_grid(self, grid: ParallelConfig) -> None:
        """Raise ValueError where the config's dimensions do not divide over `grid`.

        Args:
          grid: the parallel grid the model would run on.

        Raises:
          ValueError: a dimension of the config does not divide over the grid's axes.
        """
        self.config.check_grid(grid)

    def with_config(self, **overrides) -> "Preset":
        """The same preset with fields of its config replaced (e.g. `attention='xla'`).

        Args:
          **overrides: config fields and their new values.

        Returns:
          A new `Preset` of the same name, module and checkpoint, built from the replaced config.
        """
        return _preset(self.name, dataclasses.replace(self.config, **overrides), self.module,
                       self.checkpoint)


def _preset(name: str, config, module, checkpoint: str | None = None) -> Preset:
    return Preset(name, config, lambda dtype, grid=None: module.stacked(config, dtype, grid),
                  lambda dtype, grid=None: module.network(config, dtype, grid),
                  checkpoint=checkpoint, family=module.HF, module=module)


def _image_preset(name: str, config, module) -> Preset:
    return Preset(name, config, lambda dtype, grid=None: module.stacked(config, dtype, grid),
                  data="images")


def presets() -> dict[str, Preset]:
    """Every built-in model by name.

    Returns:
      `{name: Preset}` of the language models (GPT, Llama, Mixtral) and the image models (UNet,
      ResNet).
    """
    from . import gpt, llama, mixtral, resnet, unet

    found = {name: _preset(name, config, module)
             for module in (gpt, llama, mixtral) for name, config in module.PRESETS.items()}
    return found | {name: _image_preset(name, config, module)
                    for module in (unet, resnet) for name, config in module.PRESETS.items()}


def get(name: str) -> Preset:
    """The built-in model `name`; a clear error naming the presets otherwise.

    Args:
      name: a preset's name (`--model`).

    Returns:
      Its `Preset`.

    Raises:
      ValueError: no preset has that name (the message names the presets).
    """
    found = presets()
    if name not in found:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(found)}")
    return found[name]


def pretrained(path) -> Preset:
    """The model of a Hugging Face directory, starting from the checkpoint's parameters.

    Args:
      path: a Hugging Face model directory; its `config.json` names a Llama, a Mixtral or a GPT-2.

    Returns:
      A `Preset` named `path` whose `checkpoint` is `path`.

    Raises:
      FileNotFoundError: `path` holds no `config.json`.
      ValueError: its `model_type` is another architecture.
    """
    from . import gpt, llama, mixtral

    config_file = pathlib.Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"--init-from {str(path)!r} is not a Hugging Face model directory "
                                "(no config.json)")
    cfg = json.loads(config_file.read_text())
    families = {m.HF.model_type: m for m in (llama, gpt, mixtral)}
    if cfg.get("model_type") not in families:
        raise ValueError(f"{str(config_file)!r}: model_type {cfg.get('model_type')!r} is not "
                         f"supported (supported: {', '.join(families)})")
    module = families[cfg["model_type"]]
    return _preset(str(path), module.HF.config_from_hf(cfg), module, checkpoint=str(path))


def load_pretrained(preset: Preset, abstract, dtype=None):
    """The parameters of `preset.checkpoint`, shaped and placed like `abstract`.

    Args:
      preset: a preset with a `checkpoint` and a `family` (as `pretrained` returns).
      abstract: the parameter tree as ShapeDtypeStructs with shardings.
      dtype: the dtype the parameters load as; None: float32.

    Returns:
      The parameter tree, each array placed with its `abstract` leaf's sharding.
    """
    import jax.numpy as jnp

    from . import hf

    return preset.family.load(hf.Checkpoint(preset.checkpoint), abstract, dtype or jnp.float32)
