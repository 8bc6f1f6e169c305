"""The MoE layer measured from its programs (issue 27): FLOPs of one layer's forward and backward
against the ideal (the top_k experts each token uses: top_k / num_experts of every token through
every expert), the expert-parallel all-to-all bytes of the compiled program against
`parallel.experts.collectives`, and each expert's matmuls split over the tensor axes (per-device
FLOPs, memory, collectives). Compile only, on 8 simulated CPU devices.

    python benchmarks/bench_moe.py [--tokens 2048] [--json benchmarks/results/moe.json]

FLOPs are `analysis.hlo.flops` (dots 2·M·N·K, a `ragged-dot` 2·M·N·K, elementwise ops, reductions)
of the programs: the one XLA:CPU compiles (JAX lowers `ragged_dot` for CPU to a dense matmul of
every row against every expert, masked), the one JAX hands XLA:GPU (`lowering_platforms=
('cuda',)`, before XLA's passes: `ragged-dot` instructions), which needs no GPU to build, and
with `--h100` the one XLA:GPU compiles for an abstract H100 (no GPU needed either, but the CUDA
plugin wheels: see `_h100_sharding`):

    PYTHONPATH=DIR_WITH_CUDA_PLUGIN JAX_PLATFORMS=cpu python benchmarks/bench_moe.py --h100 --flops-only
"""
import argparse
import json
import sys

from axonn_jax.mesh import simulate_cpu_devices

SHAPES = {  # name: (d_model, d_ff, num_experts, top_k, capacity_factor)
    "mixtral-like dropless": (512, 1024, 8, 2, None),
    "mixtral-like capacity 1.25": (512, 1024, 8, 2, 1.25),
    "fine-grained dropless": (512, 256, 64, 6, None),
}
GRIDS = [(1, 2), (1, 4), (1, 8), (2, 4)]  # (data, expert)


def _layer(config, tokens, d):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from axonn_jax.models.moe import MoE

    x = jax.ShapeDtypeStruct((tokens, d), jnp.float32)
    params = nn.unbox(jax.eval_shape(MoE(config).init, jax.random.key(0), x)["params"])

    def loss(p, x):
        y, aux = MoE(config).apply({"params": p}, x)
        return jnp.sum(y) + aux["loss"]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x


def _h100_sharding():
    """A sharding on one abstract H100 (`jax.experimental.topologies`; needs jax-cuda12-plugin and
    jax-cuda12-pjrt at jaxlib's version and nvidia-cuda-nvcc-cu12, with JAX_PLATFORMS=cpu), whose
    published figures are in `h100_target_config.txtpb` beside this file."""
    import pathlib

    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    config = (pathlib.Path(__file__).parent / "h100_target_config.txtpb").read_text()
    topo = topologies.get_topology_desc(platform="cuda", topology_name="h100",
                                        target_config=config, topology="1x1x1")
    return NamedSharding(Mesh(np.array(topo.devices), ("x",)), P())


def flops_table(tokens: int, h100: bool = False) -> list[dict]:
    import jax

    from axonn_jax.analysis import hlo
    from axonn_jax.models.moe import MoEConfig

    on_h100 = _h100_sharding() if h100 else None
    rows = []
    for name, (d, ff, e, k, cf) in SHAPES.items():
        config = MoEConfig(e, k, ff, capacity_factor=cf)
        step, params, x = _layer(config, tokens, d)
        traced = step.trace(params, x)
        row = dict(shape=name, d_model=d, d_ff=ff, experts=e, top_k=k, capacity_factor=cf,
                   tokens=tokens, cpu=hlo.flops(traced.lower().compile().as_text()),
                   cuda_lowered=hlo.flops(traced.lower(lowering_platforms=("cuda",))
                                          .as_text(dialect="hlo")))
        if on_h100 is not None:
            placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                 sharding=on_h100), (params, x))
            row["h100"] = hlo.flops(step.trace(*placed).lower().compile().as_text())
        # forward + backward (input and weight gradients) = 3 × the forward's matmuls
        row["ideal"] = 3 * (3 * 2 * tokens * k * d * ff + 2 * tokens * d * e)
        row["dense"] = row["ideal"] * e / k
        rows.append(row)
    return rows


def bytes_table(tokens: int, d: int = 64) -> list[dict]:
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from axonn_jax._compat import ensure_varying, shard_map
    from axonn_jax.analysis import hlo
    from axonn_jax.models.moe import MoEConfig
    from axonn_jax.parallel import experts

    rows = []
    for cf in (None, 1.25):
        config = MoEConfig(8, 2, 128, capacity_factor=cf)
        for data, expert in GRIDS:
            n = data * expert
            mesh = Mesh(np.array(jax.devices()[:n]).reshape(data, expert), ("data", "expert"))
            step, params, x = _layer(config, tokens * n, d)
            spec = lambda leaf: P("expert") if leaf.ndim == 3 else P()  # noqa: E731
            specs = jax.tree.map(spec, params)
            local = lambda p, x: step(ensure_varying(p, ("data", "expert")), x)[1]  # noqa: E731
            stacked = jax.tree.map(lambda s: P(("data", "expert"), *s[1:]), specs,
                                   is_leaf=lambda s: isinstance(s, P))
            program = jax.jit(shard_map(local, mesh=mesh, in_specs=(specs, P(("data", "expert"))),
                                        out_specs=(stacked, P(("data", "expert")))))
            text = program.lower(params, x).compile().as_text()
            measured = sum(c.total_bytes for c in hlo.collectives(text) if c.kind == "all-to-all")
            predicted = sum(b for kind, _, b in experts.collectives(
                tokens, d, 8, 2, expert, capacity_factor=cf) if kind == "all-to-all")
            rows.append(dict(mode="dropless" if cf is None else f"capacity {cf}", data=data,
                             expert=expert, tokens_per_device=tokens, d_model=d,
                             hlo_bytes=measured, formula_bytes=predicted))
    return rows


def _tensor_mesh(expert, row, col):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    shape = (1, 1, expert, 1, row, col)
    names = ("data", "pipe", "expert", "depth", "row", "col")
    return Mesh(np.array(jax.devices()[:expert * row * col]).reshape(shape), names)


def tensor_table(tokens: int = 512, d: int = 256, ff: int = 512) -> list[dict]:
    """Per device, one layer's forward and backward inside a shard_map manual over `expert` with
    the tensor axes automatic (as in the train step): FLOPs, temporary memory and the collectives
    by kind and axes, on expert=2 alone and with row·col = 4."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from axonn_jax._compat import ensure_varying, shard_map
    from axonn_jax.analysis import hlo
    from axonn_jax.models.moe import MoE, MoEConfig

    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    rows = []
    for cf in (None, 1.0):
        config = MoEConfig(8, 2, ff, capacity_factor=cf)
        x = jax.ShapeDtypeStruct((tokens * 2, d), jnp.float32)
        boxed = jax.eval_shape(MoE(config).init, jax.random.key(0), x)["params"]
        specs = jax.tree.map(lambda s: s if is_spec(s) else P(), nn.get_partition_spec(boxed),
                             is_leaf=lambda s: s is None or is_spec(s))
        manual = jax.tree.map(lambda s: P(*(a if a == "expert" else None for a in s)), specs,
                              is_leaf=is_spec)

        def local(p, x):
            def f(p, x):
                y, aux = MoE(config).apply({"params": p}, x)
                return jnp.sum(y) + aux["loss"]
            return jax.grad(f, argnums=(0, 1))(ensure_varying(p, ("expert",)), x)[1]

        for row, col in ((1, 1), (2, 2), (4, 1), (1, 4)):
            mesh = _tensor_mesh(2, row, col)
            program = jax.jit(
                shard_map(local, mesh=mesh, in_specs=(manual, P("expert")), out_specs=P("expert"),
                          axis_names={"expert"}),
                in_shardings=(jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                           is_leaf=is_spec), NamedSharding(mesh, P("expert"))))
            compiled = program.lower(nn.unbox(boxed), x).compile()
            text = compiled.as_text()
            moved: dict = {}
            for c in hlo.collectives(text):
                key = f"{c.kind} {'·'.join(hlo.group_axes(c.group, dict(mesh.shape)))}"
                moved[key] = moved.get(key, 0) + c.total_bytes
            rows.append(dict(mode="dropless" if cf is None else f"capacity {cf}", expert=2,
                             row=row, col=col, flops=hlo.flops(text),
                             temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                             collectives=moved))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the FLOPs table's layer")
    p.add_argument("--a2a-tokens", type=int, default=256, help="tokens per device, bytes table")
    p.add_argument("--json", default=None)
    p.add_argument("--h100", action="store_true",
                   help="also compile for an abstract H100 (see _h100_sharding)")
    p.add_argument("--flops-only", action="store_true", help="the FLOPs table only")
    args = p.parse_args(argv)
    simulate_cpu_devices(8)

    flops = flops_table(args.tokens, args.h100)
    h100 = " XLA:GPU (H100) / ideal |" if args.h100 else ""
    print("| shape | ideal GFLOP | all experts / ideal | XLA:CPU / ideal | cuda-lowered / ideal |"
          + h100)
    print("|---|---|---|---|---|" + ("---|" if args.h100 else ""))
    for r in flops:
        gpu = f" {r['h100'] / r['ideal']:.3f} |" if args.h100 else ""
        print(f"| {r['shape']} | {r['ideal'] / 1e9:.3f} | {r['dense'] / r['ideal']:.2f} | "
              f"{r['cpu'] / r['ideal']:.3f} | {r['cuda_lowered'] / r['ideal']:.3f} |" + gpu,
              flush=True)
    if args.flops_only:
        return 0
    a2a = bytes_table(args.a2a_tokens)
    print("\n| mode | data | expert | all-to-all bytes (HLO) | formula |\n|---|---|---|---|---|")
    for r in a2a:
        print(f"| {r['mode']} | {r['data']} | {r['expert']} | {r['hlo_bytes']} | "
              f"{r['formula_bytes']} |", flush=True)
    tensor = tensor_table()
    print("\n| mode | expert·row·col | GFLOP / device | temporary MB | collectives (bytes) |")
    print("|---|---|---|---|---|")
    for r in tensor:
        moved = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items()))
        print(f"| {r['mode']} | {r['expert']}·{r['row']}·{r['col']} | {r['flops'] / 1e9:.3f} | "
              f"{r['temp_bytes'] / 1e6:.1f} | {moved} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"flops": flops, "all_to_all": a2a, "tensor": tensor}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
