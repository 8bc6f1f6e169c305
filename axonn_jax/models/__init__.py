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
    """A named model: `build(dtype, grid=None) -> StackedModel` (the grid it will run on, which
    may change how a layer is laid out); `network(dtype, grid=None)`: the same model as one
    linen module `tokens (b, t) -> logits (b, t, vocab)` with the same parameters (for sampling
    and export; None for image models); `data`: the batches it trains on (`tokens`:
    language-model batches `{'inputs', 'targets'}` of `(batch, seq_len)` int32; `images`: the
    config's `example_batch(batch_size)` and `batches(seed, batch_size)`, drawn procedurally);
    `config`: its shape (with `check_grid(grid)` and, for language models, `max_seq_len`,
    `vocab_size`); `checkpoint`: the Hugging Face directory
    its parameters start from (None: a fresh initialization)."""

    name: str
    config: Any
    build: Callable[..., StackedModel]
    network: Callable[..., Any] | None = None
    data: str = "tokens"
    checkpoint: str | None = None
    family: Any = None  # the architecture's Hugging Face mapping (`models.hf.Family`)
    module: Any = None  # the model's module (`models.gpt`, `models.llama`): `stacked`, `network`

    def check_grid(self, grid: ParallelConfig) -> None:
        self.config.check_grid(grid)

    def with_config(self, **overrides) -> "Preset":
        """The same preset with fields of its config replaced (e.g. `attention='xla'`)."""
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
    """Every built-in model by name."""
    from . import gpt, llama, mixtral, resnet, unet

    found = {name: _preset(name, config, module)
             for module in (gpt, llama, mixtral) for name, config in module.PRESETS.items()}
    return found | {name: _image_preset(name, config, module)
                    for module in (unet, resnet) for name, config in module.PRESETS.items()}


def get(name: str) -> Preset:
    """The built-in model `name`; a clear error naming the presets otherwise."""
    found = presets()
    if name not in found:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(found)}")
    return found[name]


def pretrained(path) -> Preset:
    """The model of the Hugging Face directory `path` (its `config.json`: a Llama, a Mixtral or a
    GPT-2), starting from the checkpoint's parameters; ValueError for another architecture."""
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
    """The parameters of `preset.checkpoint`, shaped and placed like `abstract`
    (ShapeDtypeStructs with shardings; their dtype unless `dtype`)."""
    import jax.numpy as jnp

    from . import hf

    return preset.family.load(hf.Checkpoint(preset.checkpoint), abstract, dtype or jnp.float32)
