"""Hugging Face checkpoints: a directory with `config.json` and `model.safetensors` (or shards
listed in `model.safetensors.index.json`), read straight into sharded parameters and written
back.

A model says where each of its parameter leaves lives with `Tensor`s (a Hugging Face module name
and what kind of layer it is); this module knows the two tensor layouts such directories come
in: PyTorch's (what the Hub holds; `format: pt` in the file's metadata) and Flax's (what
`transformers`' Flax models write; `format: flax`):

    kind        PyTorch name / layout          Flax name / layout      ours
    linear      .weight (out, in)              .kernel (in, out)       kernel (in, out)
    conv1d      .weight (in, out)              .kernel (out, in)       kernel (in, out)  (GPT-2)
    embedding   .weight (vocab, d)             .embedding              embedding (vocab, d)
    layernorm   .weight                        .scale                  scale
    rmsnorm     .weight                        .weight                 scale
    bias        .bias                          .bias                   bias

Reading goes through `jax.make_array_from_callback`: each process reads, with safetensors'
slicing, only the blocks its own devices hold.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import re
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for bf16 checkpoints)
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from ..checks import check_choice
from ..config import Axis, ParallelConfig
from ..mesh import config_of

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
KINDS = ("linear", "conv1d", "embedding", "layernorm", "rmsnorm", "bias")
_SUFFIX = {"pt": {"linear": "weight", "conv1d": "weight", "embedding": "weight",
                  "layernorm": "weight", "rmsnorm": "weight", "bias": "bias"},
           "flax": {"linear": "kernel", "conv1d": "kernel", "embedding": "embedding",
                    "layernorm": "scale", "rmsnorm": "weight", "bias": "bias"}}
_TRANSPOSED = {"pt": {"linear"}, "flax": {"conv1d"}}  # stored (out, in) while ours is (in, out)


def _require(module: str):
    """`module`, or ImportError saying how to install Hugging Face support."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"Hugging Face checkpoints need {module.split('.')[0]}: "
                          "pip install 'axonn_jax[hf]'") from e


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one parameter leaf lives in a Hugging Face checkpoint.

    Attributes:
      name: the Hugging Face module name, with `{}` for the layer index when `layers` > 0 (the
        leaf stacks `layers` tensors on a leading axis) and a second `{}` for the expert index
        when `experts` > 0 (the leaf stacks `experts` tensors on the next axis, Mixtral's
        `experts.{}.w1`).
      kind: what kind of layer it is, one of `KINDS` (see the module docstring).
      offset: the leaf is columns `[offset, offset + n)` of the tensor's output features
        (GPT-2's fused query/key/value projection).
    """

    name: str
    kind: str
    layers: int = 0
    offset: int = 0
    experts: int = 0

    def __post_init__(self):
        check_choice("Tensor kind", self.kind, KINDS)

    @property
    def stacked(self) -> tuple[int, ...]:
        """Sizes of the leaf's leading axes that stack tensors (layers, then experts)."""
        return tuple(n for n in (self.layers, self.experts) if n)

    def indices(self) -> list[tuple[int, ...]]:
        """The index into the stacked axes of each tensor, in `names` order.

        Returns:
          One tuple per tensor (layer, then expert), layer-major; `[()]` for an unstacked leaf.
        """
        return list(itertools.product(*map(range, self.stacked)))

    def names(self, fmt: str) -> list[str]:
        """The tensor names in a checkpoint of format `fmt`, one per layer (and expert).

        Args:
          fmt: the checkpoint's tensor layout, 'pt' or 'flax'.

        Returns:
          The full tensor names (with the kind's suffix), layer-major.
        """
        full = f"{self.name}.{_SUFFIX[fmt][self.kind]}"
        return [full.format(*i) for i in self.indices()]

    def transposed(self, fmt: str) -> bool:
        """Whether format `fmt` stores this tensor `(out, in)` while ours is `(in, out)`.

        Args:
          fmt: the checkpoint's tensor layout, 'pt' or 'flax'.

        Returns:
          True for PyTorch's `linear` and Flax's `conv1d` kernels.
        """
        return self.kind in _TRANSPOSED[fmt]


def expect(config: dict, key: str, allowed: tuple, default=None) -> None:
    """Raise ValueError unless `config[key]` (or `default` when absent) is one of `allowed`.

    Args:
      config: a `config.json` dict.
      key: the field to check.
      allowed: the values this package supports.
      default: the value Hugging Face assumes when the field is absent.

    Raises:
      ValueError: the value is not supported (the message names the supported ones).
    """
    value = config.get(key, default)
    if value not in allowed:
        raise ValueError(f"config.json: {key} = {value!r} is not supported (supported: "
                         f"{', '.join(map(repr, allowed))})")


class Checkpoint:
    """An opened Hugging Face directory: its config, its tensors' names and shapes, its layout.

    Attributes:
      config: the `config.json` dict.
      format: the tensor layout, 'pt' or 'flax' (the first file's metadata; 'pt' if none).
      file_of: `{tensor name: the safetensors file holding it}`.

    Raises:
      FileNotFoundError: the directory has no `config.json`, or neither `model.safetensors` nor
        `model.safetensors.index.json`.
      ValueError: the tensor format is neither 'pt' nor 'flax'.
    """

    def __init__(self, path):
        self.path = pathlib.Path(path)
        if not (self.path / CONFIG).is_file():
            raise FileNotFoundError(f"{str(self.path)!r} is not a Hugging Face model directory "
                                    f"(no {CONFIG})")
        self.config = json.loads((self.path / CONFIG).read_text())
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.path / WEIGHTS).is_file():
            files = [WEIGHTS]
        else:
            raise FileNotFoundError(f"{str(self.path)!r} holds neither {WEIGHTS} nor {INDEX} "
                                    "(only safetensors checkpoints are read)")
        safe_open = _require("safetensors").safe_open
        self._files = {f: safe_open(str(self.path / f), framework="numpy") for f in files}
        self.file_of = {name: f for f, handle in self._files.items() for name in handle.keys()}
        meta = self._files[files[0]].metadata() or {}
        self.format = meta.get("format", "pt")
        if self.format not in _SUFFIX:
            raise ValueError(f"{str(self.path / files[0])!r}: tensor format {self.format!r} is "
                             "not read (supported: pt, flax)")

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name` as stored in its file.

        Args:
          name: a tensor name as this checkpoint spells it (see `resolve`).

        Returns:
          The stored shape (PyTorch or Flax layout, see `format`).
        """
        return tuple(self._files[self.file_of[name]].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block `index` of tensor `name`, read from the file.

        Args:
          name: a tensor name as this checkpoint spells it.
          index: slices, one per axis of the stored tensor.

        Returns:
          The block as a numpy array of the stored dtype.
        """
        return self._files[self.file_of[name]].get_slice(name)[index]

    def resolve(self, name: str) -> str | None:
        """`name` as this checkpoint spells it, or None when absent.

        Args:
          name: a tensor name with its full prefix.

        Returns:
          `name` as is, or without its first component (GPT-2 checkpoints on the Hub lack the
          `transformer.` prefix); None when neither is in the files.
        """
        if name in self.file_of:
            return name
        short = name.split(".", 1)[-1]
        return short if short in self.file_of else None

    def load(self, tensors: dict[tuple[str, ...], Tensor], abstract, dtype,
             ignore: tuple[str, ...] = ()):
        """The parameters described by `tensors`, shaped and placed like `abstract`.

        Each process reads only the blocks its own devices hold.

        Args:
          tensors: `{leaf path: Tensor}` for every leaf of `abstract`.
          abstract: a tree of ShapeDtypeStructs with shardings.
          dtype: the dtype of the arrays.
          ignore: regular expressions of checkpoint tensors that are not parameters.

        Returns:
          The parameter tree of `dtype` arrays with `abstract`'s shapes and shardings.

        Raises:
          ValueError: naming every leaf without a mapping, missing tensor, shape mismatch, and
            unexpected tensor (other than those matching `ignore`).
        """
        flat = traverse_util.flatten_dict(abstract)
        if set(flat) != set(tensors):
            raise ValueError(f"no checkpoint mapping for parameters "
                             f"{sorted('/'.join(p) for p in set(flat) - set(tensors))}")
        sources = self._sources(tensors, flat, ignore)
        out = {path: self._array(tensors[path], sources[path], flat[path], dtype) for path in flat}
        return traverse_util.unflatten_dict(out)

    def _sources(self, tensors, flat, ignore) -> dict[tuple[str, ...], list[str]]:
        """`{leaf path: the names of its tensors}`, checked against the files (see `load`)."""
        sources, problems = {}, []
        for path, t in tensors.items():
            names, want = [self.resolve(n) for n in t.names(self.format)], flat[path].shape
            missing = [n for n, r in zip(t.names(self.format), names) if r is None]
            if missing:
                problems.append(f"missing tensor(s) {', '.join(missing[:3])}"
                                + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""))
                continue
            layer_shape = want[len(t.stacked):]
            group = _group(tensors, t)  # the leaves that make up this tensor (fused: several)
            width = sum((flat[p].shape[-1] for p in group), 0) if len(group) > 1 else layer_shape[-1]
            needed = (*layer_shape[:-1], width)
            for n in names:
                have = self.shape(n)
                if (have[::-1] if t.transposed(self.format) else have) != needed:
                    stored = needed[::-1] if t.transposed(self.format) else needed
                    problems.append(f"{n} has shape {have}, the model needs {stored} for "
                                    f"{'/'.join(path)}")
                    break
            sources[path] = names
        used = {n for names in sources.values() for n in names}
        extra = sorted(n for n in self.file_of if n not in used
                       and not any(re.fullmatch(p, n) for p in ignore))
        if extra:
            problems.append(f"unexpected tensor(s) {', '.join(extra[:5])}"
                            + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else ""))
        if problems:
            raise ValueError(f"checkpoint {str(self.path)!r} does not match the model: "
                             + "; ".join(problems))
        return sources

    def _array(self, t: Tensor, names: list[str], abstract, dtype):
        transposed = t.transposed(self.format)
        cache: dict = {}  # devices holding the same block share one read

        def block(index):
            key = tuple((s.start, s.stop) for s in index)
            if key not in cache:
                k = len(t.stacked)
                ranges = [range(n)[s] for n, s in zip(t.stacked, index[:k])]
                position = lambda i: int(np.ravel_multi_index(i, t.stacked)) if i else 0  # noqa: E731
                parts = [self._block(names[position(i)], index[k:], transposed, t.offset)
                         for i in itertools.product(*ranges)]
                cache[key] = parts[0] if not k else \
                    np.stack(parts).reshape(*map(len, ranges), *parts[0].shape)
                cache[key] = cache[key].astype(dtype)
            return cache[key]

        shape = abstract.shape
        full = tuple(slice(0, n) for n in shape)

        def callback(index):
            index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape)) or full
            return block(index)

        return jax.make_array_from_callback(shape, abstract.sharding, callback)

    def _block(self, name, index, transposed, offset):
        index = list(index)
        if offset:
            last = index[-1]
            index[-1] = slice(last.start + offset, last.stop + offset)
        data = self.read(name, tuple(index[::-1] if transposed else index))
        return data.T if transposed else data


def _group(tensors: dict, t: Tensor) -> list[tuple[str, ...]]:
    """The leaves stored in `t`'s tensor (several for GPT-2's fused query/key/value)."""
    return [p for p, other in tensors.items() if (other.name, other.kind) == (t.name, t.kind)]


@dataclasses.dataclass(frozen=True)
class Family:
    """How one architecture meets Hugging Face's.

    Attributes:
      model_type: the `model_type` of its `config.json`.
      config_from_hf: `config_from_hf(config.json dict) -> config`.
      config_to_hf: `config_to_hf(config, dtype name) -> dict`.
      tensors: `tensors(config) -> {leaf path: Tensor}`.
      network: `network(config, dtype, grid) -> module` (tokens -> logits).
      ignore: regular expressions of checkpoint tensors that are not parameters (buffers of
        old exports).
    """

    model_type: str
    config_from_hf: Callable
    config_to_hf: Callable
    tensors: Callable
    network: Callable
    ignore: tuple[str, ...] = ()

    def load(self, checkpoint: Checkpoint, abstract, dtype=jnp.float32):
        """`checkpoint`'s parameters, of `dtype`, shaped and placed like `abstract`.

        With tied embeddings an output matrix in the files is ignored (as in transformers).

        Args:
          checkpoint: the opened directory.
          abstract: the parameter tree as ShapeDtypeStructs with shardings.
          dtype: the parameters' dtype.

        Returns:
          The parameter tree (see `Checkpoint.load`).
        """
        config = self.config_from_hf(checkpoint.config)
        # With tied embeddings an output matrix in the files is not used (as in transformers).
        tied = (r"lm_head\.(weight|kernel)",) if config.tie_embeddings else ()
        return checkpoint.load(self.tensors(config), abstract, dtype, ignore=self.ignore + tied)

    def from_pretrained(self, path, mesh=None, dtype=jnp.float32):
        """`(module, params)` of a Hugging Face directory (see `models.llama.from_pretrained`).

        Args:
          path: the directory.
          mesh: the mesh to place the parameters on and make the module tensor-parallel over;
            None: the default device.
          dtype: the module's and the parameters' dtype.

        Returns:
          `(module, params)`: the network (tensor-parallel when `mesh` has tensor axes of more
          than one device) and its parameters, placed as `shardings` says.
        """
        checkpoint = Checkpoint(path)
        config = self.config_from_hf(checkpoint.config)
        module = self.network(config, dtype, grid_of(mesh))
        params = self.load(checkpoint, shardings(module, mesh, config.max_seq_len), dtype)
        return parallel_module(module, mesh), params

    def to_pretrained(self, module, params, path, dtype=None, max_shard_bytes: int = 5 * 2**30):
        """Write `params` of `module` as a Hugging Face directory (see `save`).

        Args:
          module: a module whose `.config` is this family's.
          params: its parameters.
          path: the directory to write.
          dtype: the dtype to store; None: the first parameter leaf's.
          max_shard_bytes: the most bytes of one safetensors shard.
        """
        config = module.config
        save(path, self.tensors(config), params, lambda d: self.config_to_hf(config, d), dtype,
             max_shard_bytes)


# ----------------------------------------------------------------------------- placement

def grid_of(mesh) -> ParallelConfig | None:
    """The grid of `mesh`.

    Args:
      mesh: a mesh of this package's axes, or None.

    Returns:
      Its `ParallelConfig`, or None without a mesh.
    """
    return None if mesh is None else config_of(mesh)


def _tensor_parallel(mesh) -> bool:
    return mesh is not None and config_of(mesh).tensor_parallel_size > 1


def parallel_module(module, mesh):
    """`module` made tensor-parallel on `mesh` (`axonn_jax.parallelize`).

    Args:
      module: a linen module.
      mesh: a mesh, or None.

    Returns:
      The parallelized module; `module` unchanged without a mesh, or when its tensor axes
      (`depth`, `row`, `col`) hold one device.
    """
    from ..tp.parallelize import parallelize

    return parallelize(module, mesh) if _tensor_parallel(mesh) else module


def shardings(module, mesh, max_seq_len: int):
    """ShapeDtypeStructs (with shardings) of a language model's parameters.

    Args:
      module: a linen `tokens -> logits` module.
      mesh: the mesh to place them on, or None.
      max_seq_len: the model's longest sequence (the traced input is at most 8 tokens).

    Returns:
      The parameter tree as ShapeDtypeStructs, split over the tensor axes (`depth`, `row`,
      `col`) as `axonn_jax.parallelize` lays them out and replicated over the others; on the
      default device without a mesh.
    """
    parallel = parallel_module(module, mesh)
    rows = 1 if mesh is None else mesh.shape[Axis.DEPTH]
    tokens = jax.ShapeDtypeStruct((rows, min(8, max_seq_len)), jnp.int32)
    boxed = jax.eval_shape(parallel.init, jax.random.key(0), tokens)["params"]
    shapes = nn.unbox(boxed)
    if mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), shapes)
    specs = nn.get_partition_spec(boxed) if _tensor_parallel(mesh) else \
        jax.tree.map(lambda _: P(), shapes)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                          sharding=NamedSharding(mesh, s)),
                        shapes, specs, is_leaf=lambda x: isinstance(x, P))


# ----------------------------------------------------------------------------- writing

def _host(x) -> np.ndarray:
    """A (possibly multi-process) array as one host numpy array (a collective across processes)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _hf_tensors(tensors: dict[tuple[str, ...], Tensor]):
    """`{hf name: [(leaf path, index into its stacked axes, Tensor), ...]}` in the PyTorch
    layout; several leaves at increasing offsets make up a fused tensor."""
    out: dict[str, list] = {}
    for path, t in tensors.items():
        for index, name in zip(t.indices(), t.names("pt")):
            out.setdefault(name, []).append((path, index, t))
    for parts in out.values():
        parts.sort(key=lambda p: p[2].offset)
    return out


def save(path, tensors: dict[tuple[str, ...], Tensor], params, make_config: Callable[[str], dict],
         dtype=None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `params` as a Hugging Face directory in the PyTorch layout.

    The directory gets `config.json` and the tensors, in one `model.safetensors` or in shards of
    at most `max_shard_bytes` (a tensor larger than that gets a shard of its own) with an index.
    Every process must call it (gathering a multi-process array is collective); process 0
    writes.

    Args:
      path: the directory to write (created if needed).
      tensors: `{leaf path: Tensor}` for every leaf of `params`.
      params: the parameter tree.
      make_config: `make_config(dtype name) -> config.json dict`.
      dtype: the dtype to store; None: the first parameter leaf's.
      max_shard_bytes: the most bytes of one shard.

    Raises:
      ValueError: the leaves of `params` do not match `tensors` (naming the missing and the
        unexpected ones).
    """
    save_file = _require("safetensors.numpy").save_file
    flat = traverse_util.flatten_dict(params)
    if set(flat) != set(tensors):
        raise ValueError(f"to_pretrained: the parameters do not match the model: missing "
                         f"{sorted('/'.join(p) for p in set(tensors) - set(flat))}, unexpected "
                         f"{sorted('/'.join(p) for p in set(flat) - set(tensors))}")
    dtype = np.dtype(dtype or jax.tree.leaves(params)[0].dtype)
    names = _hf_tensors(tensors)

    def nbytes(name):
        return sum(math.prod(flat[p].shape[len(i):]) for p, i, _ in names[name]) * dtype.itemsize

    shards, size = [[]], 0
    for name in names:
        if shards[-1] and size + nbytes(name) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(name)
    files = [WEIGHTS] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    out = pathlib.Path(path)
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    for file, shard in zip(files, shards):
        data = {}
        for name in shard:
            # One layer (and expert) of one leaf on the host at a time.
            parts = [_host(flat[leaf][index] if index else flat[leaf]) for leaf, index, _ in names[name]]
            block = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
            t = names[name][0][2]
            data[name] = np.ascontiguousarray(block.T if t.transposed("pt") else block, dtype)
        if writer:
            save_file(data, str(out / file), metadata={"format": "pt"})
    if not writer:
        return
    if len(files) > 1:
        weight_map = {n: f for f, shard in zip(files, shards) for n in shard}
        total = sum(nbytes(n) for n in names)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": weight_map}, indent=2) + "\n")
    (out / CONFIG).write_text(json.dumps(make_config(dtype.name), indent=2) + "\n")
