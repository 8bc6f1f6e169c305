"""The one place that knows which JAX version is running.

CPU machines run JAX 0.10.x and GPU machines 0.11.x; APIs that moved between versions (shard_map,
compute_on, memory kinds) are wrapped here so the rest of the package has one spelling for each.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import jax

if hasattr(jax, "shard_map"):
    _shard_map = jax.shard_map
else:  # pragma: no cover - JAX < 0.7
    from jax.experimental.shard_map import shard_map as _old_shard_map

    def _shard_map(f, *, mesh, in_specs, out_specs, axis_names=frozenset(), check_vma=True):
        auto = frozenset(mesh.axis_names) - frozenset(axis_names) if axis_names else frozenset()
        return _old_shard_map(f, mesh, in_specs, out_specs, check_rep=check_vma, auto=auto)


def shard_map(
    f: Callable,
    *,
    mesh,
    in_specs: Any,
    out_specs: Any,
    axis_names: set[str] | frozenset[str] | None = None,
    check_vma: bool = True,
) -> Callable:
    """`jax.shard_map`, manual over `axis_names` (all mesh axes when None), automatic over the rest."""
    kwargs = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    if axis_names is not None:
        kwargs["axis_names"] = frozenset(axis_names)
    return _shard_map(f, **kwargs)


def nested_shard_map(f: Callable, *, mesh, in_specs, out_specs, axis_names,
                     kept_specs: tuple = ()) -> Callable:
    """`shard_map(f, ...)` manual over `axis_names` inside an enclosing shard_map (manual over
    other axes of `mesh`, the context's abstract mesh), differentiable inside `lax.scan`.

    `f(*args) -> array` computes each device's block; `in_specs` is a tuple (one spec per
    argument). With `kept_specs`, `f(keep, *args)` passes the values the backward must not
    compute again through `keep(value)` (one call per spec, in order): the collectives over the
    enclosing axes, whose results the backward reads.

    JAX 0.10 to 0.12 (check_vma) give the residuals that partial evaluation cuts out of a nested
    shard_map specs over every axis they vary over, the enclosing shard_map's manual axes
    included, and a scan over layers hoists loop-invariant pieces of the shard_map into such
    residuals: their shapes come out multiplied by those axes' sizes and the program fails to
    lower. So the forward shard_map does not check replication (its outputs are given the
    enclosing axes its arguments vary over) and keeps as residuals only the arguments and the
    kept values, under the specs given here; the backward shard_map, which no partial evaluation
    cuts, runs `f`'s forward again with each kept value in place of its computation and `f`'s
    VJP, with replication checked (JAX sums the cotangent of an argument over the axes its spec
    leaves it whole on where the output is split). A kept value's computation differentiates as
    before (its linear map is the one transposed) while its forward result is dead code.

    Args:
      f: the per-device function, `f(*args)`, or `f(keep, *args)` with `kept_specs`.
      mesh: the context's abstract mesh.
      in_specs: one PartitionSpec per argument over `axis_names`.
      out_specs: the output's PartitionSpec (or pytree of them).
      axis_names: the mesh axes manual inside.
      kept_specs: one PartitionSpec per kept value, as the forward hands it to the backward.

    Returns:
      The function of the global arguments.
    """
    import jax

    def outer(args):  # the enclosing axes the arguments vary over
        leaves = jax.tree.leaves(args)
        return tuple(sorted(set().union(*map(varying_axes, leaves)) - set(axis_names)))

    def sm(fn, ins, outs, check):
        return shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs, axis_names=axis_names,
                         check_vma=check)

    def recording(*args):  # (output, the kept values)
        kept = []
        out = f(lambda v: kept.append(v) or v, *args) if kept_specs else f(*args)
        return out, tuple(kept)

    def replaying(kept, *args):  # the output, each kept value standing in for its computation
        values = iter(kept)
        return f(lambda v: _stand_in(ensure_varying(next(values), tuple(varying_axes(v))), v),
                 *args) if kept_specs else f(*args)

    def forward(*args):
        out, kept = sm(recording, in_specs, (out_specs, tuple(kept_specs)), False)(*args)
        return ensure_varying((out, kept), outer(args))

    @jax.custom_vjp
    def call(*args):
        return forward(*args)[0]

    def fwd(*args):
        out, kept = forward(*args)
        return out, (args, kept)

    def bwd(res, g):
        args, kept = res
        local = lambda g, kept, *a: jax.vjp(lambda *a: replaying(kept, *a), *a)[1](g)  # noqa: E731
        cts = sm(local, (out_specs, tuple(kept_specs), *in_specs), in_specs, True)(g, kept, *args)
        return jax.tree.map(lambda ct, a: ensure_varying(ct, tuple(sorted(varying_axes(a)))),
                            tuple(cts), args)

    call.defvjp(fwd, bwd)
    return call


@jax.custom_jvp
def _stand_in(kept, computed):
    """`kept`, differentiated as `computed` (the same shape, dtype and varying axes)."""
    return kept


@_stand_in.defjvp
def _stand_in_jvp(primals, tangents):
    return primals[0], tangents[1]


HOST_MEMORY_KIND = "pinned_host"
DEVICE_MEMORY_KIND = "device"


def with_memory_kind(sharding, kind: str):
    """`sharding` in memory `kind`, also for compile-only devices (`analysis.targets`' abstract
    GPUs), which list no memories, so that `with_memory_kind` silently drops the kind there: a
    NamedSharding on the mesh's abstract mesh keeps it."""
    out = sharding.with_memory_kind(kind)
    if out.memory_kind != kind and isinstance(sharding, jax.sharding.NamedSharding) \
            and isinstance(sharding.mesh, jax.sharding.Mesh):
        out = jax.sharding.NamedSharding(sharding.mesh.abstract_mesh, sharding.spec,
                                         memory_kind=kind)
    return out


def compute_on_host(f: Callable, out_memory_spaces) -> Callable:
    """`f` (traced under `jax.jit`) run by the host's CPU inside a device program (XLA's
    HostExecute; on XLA:CPU the same memory).

    Args:
      f: the function; its array arguments should be in host memory.
      out_memory_spaces: a `jax.memory.Space` per output of `f` (JAX 0.11+ asks for them;
        JAX 0.10 takes them from `f`'s own placements).

    Returns:
      The wrapped function.
    """
    from jax.experimental.compute_on import compute_on

    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(jax.jit(f), compute_type="device_host",
                          out_memory_spaces=out_memory_spaces)
    return compute_on("device_host")(jax.jit(f))


def in_host_memory(x) -> bool:
    """Whether `x` (an array or a tracer) lives in host memory.

    E.g. an offloaded residual of `--remat offload`, a gradient of `--offload-gradients`."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def memory_kind_of(x: jax.Array) -> str | None:
    """The memory kind an array lives in (`device`, `pinned_host`, ...), or None for non-arrays."""
    sharding = getattr(x, "sharding", None)
    return getattr(sharding, "memory_kind", None)


def to_varying(tree, axes: tuple[str, ...]):
    """Mark every array of `tree` as varying over the manual `axes` of the enclosing shard_map.

    Gradients of a varying input are per-shard (not summed by autodiff), so the train step can
    reduce them itself — exactly, compressed, or on the host.
    """
    import jax

    if not axes:
        return tree
    if hasattr(jax.lax, "pcast"):
        return jax.tree.map(lambda x: jax.lax.pcast(x, tuple(axes), to="varying"), tree)
    return jax.tree.map(lambda x: jax.lax.pvary(x, tuple(axes)), tree)  # pragma: no cover


def current_mesh(default):
    """The mesh to hand a nested shard_map: the abstract context mesh inside an enclosing shard_map
    (JAX requires the inner one to match it), else `default`."""
    import jax

    abstract = jax.sharding.get_abstract_mesh()
    return default if abstract.empty else abstract


def tracing_in(mesh):
    """A context manager under which code traced inside `jax.jit` sees `mesh` (a `Mesh`) as the
    context's abstract mesh, as it does inside a shard_map over it; a no-op where a mesh is
    already in context. For steps that run their model on global arrays without a shard_map
    (`data` = 1 beside tensor axes), so that whatever reads the context mesh (`mesh_platform`,
    `current_mesh`, `models.attention.fully_manual`; a user's model through them or through
    `jax.sharding.get_abstract_mesh`) finds the step's mesh on every grid: JAX's own context,
    not a second one of ours that only our code would read. (`jax.set_mesh` is refused inside
    `jax.jit`. An abstract mesh of automatic axes only names the mesh: the fp32 CPU step compiles
    to the same HLO with and without it on depth, depth·row·col and row·col grids.)"""
    import contextlib

    import jax

    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes over which `x` varies inside a shard_map (empty outside one)."""
    import jax

    return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval) -> frozenset[str]:
    """`varying_axes` of an abstract value (a ShapedArray, or a ShapeDtypeStruct from
    `jax.eval_shape` inside a shard_map)."""
    mat = getattr(aval, "manual_axis_type", None)  # JAX 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # pragma: no cover - other JAX versions


def shape_dtype_like(shape, dtype, like) -> "jax.ShapeDtypeStruct":
    """A ShapeDtypeStruct of `shape` and `dtype` typed varying over the manual axes `like` varies
    over (what `pallas_call`'s `out_shape` needs inside a shard_map that checks replication)."""
    import inspect

    import jax

    aval = jax.typeof(like)
    params = inspect.signature(jax.ShapeDtypeStruct.__init__).parameters
    if "manual_axis_type" in params:  # JAX 0.10
        return jax.ShapeDtypeStruct(shape, dtype,
                                    manual_axis_type=getattr(aval, "manual_axis_type", None))
    if "vma" in params:  # pragma: no cover - other JAX versions
        return jax.ShapeDtypeStruct(shape, dtype, vma=getattr(aval, "vma", None))
    return jax.ShapeDtypeStruct(shape, dtype)  # pragma: no cover


def triton_compiler_params():
    """Pallas compiler parameters that pick the Triton backend on GPUs (JAX 0.10 defaults to
    Mosaic GPU where it is installed); None where no Triton params exist."""
    try:
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams()
    except (ImportError, AttributeError):  # pragma: no cover - older JAX
        try:
            from jax.experimental.pallas import gpu as plgpu

            return plgpu.TritonCompilerParams()
        except (ImportError, AttributeError):
            return None


def ensure_varying(tree, axes: tuple[str, ...]):
    """Like `to_varying`, but leaves already varying over some of `axes` (e.g. arrays split over
    `pipe`) are cast over the missing axes only; `pcast` refuses an axis the input already varies in."""
    import jax

    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return to_varying(x, missing) if missing else x

    return jax.tree.map(cast, tree)


def kernel_operands(*arrays):
    """`(arrays, out_struct)` for a Pallas call inside a shard_map with `check_vma`: the arrays
    cast to vary over every manual axis one of them varies over, and `out_struct(shape, dtype)`,
    a `ShapeDtypeStruct` that varies over the same axes (what `pallas_call` needs of its
    `out_shape` there; JAX 0.10 to 0.12 call the field `manual_axis_type`)."""
    import jax

    axes = tuple(sorted(frozenset().union(*map(varying_axes, arrays))))
    arrays = tuple(ensure_varying(list(arrays), axes))
    mat = getattr(jax.typeof(arrays[0]), "manual_axis_type", None) if axes else None

    def out_struct(shape, dtype):
        if mat is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)

    return arrays, out_struct


def mesh_platform(mesh=None) -> str | None:
    """The platform (`cpu`, `gpu`, `tpu`) of `mesh`'s devices (a `Mesh` or `AbstractMesh`); without
    one, of the mesh in context (inside a shard_map, or under `jax.set_mesh`). None when unknown.

    The code a step compiles to depends on the platform of its mesh, not of this process: a
    program compiled on a CPU host for abstract H100s (`analysis.targets`) is a GPU program."""
    import jax

    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return None
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0].platform
    device = getattr(mesh, "abstract_device", None)
    return None if device is None else device.platform


def platform_or_default(platform: str | None = None) -> str:
    """`platform`, else the context mesh's (`mesh_platform`), else JAX's default backend."""
    import jax

    return platform or mesh_platform() or jax.default_backend()


def _reduce_16bit_in_fp32(reduce, tree):
    """Apply `reduce` leafwise; for CPU meshes, 16-bit float arrays are reduced in fp32 and cast
    back (runs inside shard_maps, whose mesh names the platform).

    XLA:CPU's all-reduce promotion pass aborts the process ("Invalid binary instruction opcode
    copy") on a bf16/fp16 all-reduce or reduce-scatter inside a partially manual shard_map, whose
    reducer ends in a sharding annotation (JAX 0.10.2).
    """
    import jax
    import jax.numpy as jnp

    if platform_or_default() != "cpu":
        return jax.tree.map(reduce, tree)

    def one(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits == 16:
            return reduce(x.astype(jnp.float32)).astype(x.dtype)
        return reduce(x)

    return jax.tree.map(one, tree)


def psum(tree, axis):
    """`jax.lax.psum` over `axis` (a name or tuple), CPU-safe for 16-bit floats (see above)."""
    import jax

    return _reduce_16bit_in_fp32(lambda x: jax.lax.psum(x, axis), tree)


def pmean(tree, axis):
    """`jax.lax.pmean` over `axis`, CPU-safe for 16-bit floats."""
    import jax

    return _reduce_16bit_in_fp32(lambda x: jax.lax.pmean(x, axis), tree)


def psum_scatter(x, axis, **kwargs):
    """`jax.lax.psum_scatter` over `axis`, CPU-safe for 16-bit floats."""
    import jax

    return _reduce_16bit_in_fp32(lambda v: jax.lax.psum_scatter(v, axis, **kwargs), x)


def all_gather_invariant(x, axis_name):
    """`all_gather` whose result is typed invariant (replicated) over `axis_name`.

    Plain `all_gather` returns a value typed varying, which a shard_map cannot return under an
    unsplit out_spec. JAX 0.12 asks for the invariant type with `all_gather(..., to="invarying")`;
    before, the invariant variant was private.
    """
    import inspect

    import jax

    if "to" in inspect.signature(jax.lax.all_gather).parameters:
        return jax.lax.all_gather(x, axis_name, to="invarying")
    from jax._src.lax import parallel

    return parallel.all_gather_invariant(x, axis_name)


def gathered_invariant(gather: Callable, x, axis: str):
    """`gather(x)` typed invariant over the manual axis `axis`, or None where it cannot be.

    `gather` runs collectives over groups of `axis` (`axis_index_groups`) that leave every shard
    of it the same value, e.g. an all-gather across nodes and then one inside each node. JAX types
    only a whole-axis gather as invariant (`all_gather_invariant`); this runs `gather` in a nested
    shard_map, manual over one axis that is not manual here (one of size 1 where there is one),
    that does not check replication, so its result leaves typed invariant over the enclosing
    manual axes, and is cast back to those other than `axis` that `x` varies over. Correct only
    where the value really is equal on every shard of `axis`.

    Args:
      gather: `x -> value`, the same value on every shard of `axis`.
      x: the operand, inside a shard_map manual over `axis`.
      axis: the manual mesh axis the value is equal over.

    Returns:
      `gather(x)`, typed invariant over `axis`; None where every mesh axis is manual here (no
      shard_map can nest), for the caller to gather over the whole axis instead.
    """
    import jax
    from jax.sharding import PartitionSpec

    mesh = jax.sharding.get_abstract_mesh()
    manual = set(manual_axes())
    free = sorted((a for a in mesh.axis_names if a not in manual), key=lambda a: mesh.shape[a] != 1)
    if not free:
        return None
    out = shard_map(gather, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                    axis_names={free[0]}, check_vma=False)(x)
    return ensure_varying(out, tuple(sorted(varying_axes(x) - {axis})))


def jaxpr_internals():
    """What `parallel.backward_split` needs to read and re-run jaxprs: `Literal`, `DropVar` and
    `dce_eqn`, JAX's dead-code elimination of one equation (its rules are private)."""
    import inspect
    import types

    import jax.extend.core as core
    from jax._src.interpreters import partial_eval as pe

    def dce_eqn(used: list[bool], eqn):
        """`eqn` computing only its `used` outputs. JAX 0.12's rules also take which inputs are
        live (references only; every input here)."""
        rule = pe.dce_rules[eqn.primitive]
        if len(inspect.signature(rule).parameters) == 3:
            return rule(used, [True] * len(eqn.invars), eqn)[1]
        return rule(used, eqn)[1]

    return types.SimpleNamespace(Literal=core.Literal, DropVar=core.DropVar, Var=core.Var,
                                 dce_eqn=dce_eqn)


def manual_axes() -> tuple[str, ...]:
    """The mesh axes that are manual in the enclosing shard_map (none outside one)."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(getattr(mesh, "manual_axes", ()))


def automatic_axes() -> tuple[str, ...]:
    """The context mesh's axes of more than one device that are automatic here (not manual in
    an enclosing shard_map); none without a mesh in context."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(
        a for a in mesh.axis_names if a not in manual_axes() and mesh.shape[a] > 1)


def manual_axis_size(name: str) -> int:
    """The size of mesh axis `name` when it is manual in the enclosing shard_map, else 1 (the
    axis is absent, automatic, or there is no shard_map: the code sees the whole of it)."""
    import jax

    return jax.sharding.get_abstract_mesh().shape[name] if name in manual_axes() else 1


def register_cuda_plugin() -> bool:
    """Register the CUDA PJRT plugin (`jax_plugins.xla_cuda12`) with JAX when its discovery at
    start-up did not see it (it was not on sys.path then): True when JAX has a CUDA topology
    factory afterwards. Only compile-only use needs this (`analysis.targets`); JAX's plugin
    registry is private, so it is reached here."""
    from jax._src import xla_bridge as xb

    if "cuda" in xb._topology_factories:
        return True
    if "cuda" in xb._backends:  # a live CUDA backend, registered at start-up
        return True
    import importlib

    try:
        plugin = importlib.import_module("jax_plugins.xla_cuda12")
    except ImportError:
        return False
    plugin.initialize()
    _adopt_cuda_versions()
    return "cuda" in xb._topology_factories


def _adopt_cuda_versions() -> None:
    """Give JAX the plugin's `_versions` module, which `import jax` looks for once and remembers
    (None when the plugin was not importable then); cuDNN fused attention reads it to compile."""
    import importlib
    import sys

    from jax._src import lib

    if lib.cuda_versions is not None:
        return
    try:
        lib.cuda_versions = importlib.import_module("jax_cuda12_plugin._versions")
    except ImportError:
        return
    for name in ("jax._src.cudnn.fused_attention_stablehlo", "jax._src.lax.linalg"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "cuda_versions", False) is None:
            module.cuda_versions = lib.cuda_versions


def scan_layout(params) -> tuple[int, int, object, list]:
    """A `scan` equation's `(number of consts, number of carries, body jaxpr, body consts)`.

    JAX 0.12 describes the operands with flat trees (`ft_in`: consts, carries, xs) and binds an
    open body jaxpr; before, with counts and a closed jaxpr.
    """
    if "num_consts" in params:
        body = params["jaxpr"]
        return params["num_consts"], params["num_carry"], body.jaxpr, list(body.consts)
    consts, carry, _ = params["ft_in"].unpack()
    body = params["jaxpr"]
    return len(consts), len(carry), body, list(body.consts)


def detected_cluster() -> str | None:
    """The cluster `jax.distributed.initialize`'s default detection would join this process to.

    JAX answers "no cluster" only by raising from `initialize`, so its detectors (internal, the
    same since JAX 0.4) are asked here in its own order, opt-in methods (mpi4py) left out.

    Returns:
      The detector's name ("slurm", "ompi", "gcetpu", ...; its class name where it has none), or
      None when no cluster environment is present.
    """
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env.name or env.__name__
    return None


def distributed_grid() -> tuple[str | None, int, int]:
    """The grid of the distributed runtime this process joined, read without starting a backend.

    Returns:
      (coordinator `host:port`, process count, process id); (None, 1, 0) before any join.
    """
    from jax._src import distributed

    state = distributed.global_state
    return state.coordinator_address, state.num_processes, state.process_id
