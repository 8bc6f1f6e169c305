"""Context-parallel attention (issue 26): per device, for ring and all-gather attention over
context = 1, 2, 4, 8, the compiled program's FLOPs (HLO, loop bodies times their trip counts)
against the kernel's block model (`context.flops`), its collective bytes against the
communication model (`context.collectives`), and its temporary memory, for the forward and
backward pass of a stack of attention layers (a `lax.scan`, as the train step runs blocks), on
8 simulated CPU devices. Compile only. The first row is one device's XLA attention
(`jax.nn.dot_product_attention`, differentiated by autodiff) at the same shape.

    XLA_FLAGS=--xla_backend_optimization_level=0 python benchmarks/bench_context.py
    ... --seq-len 4096 --heads 8 --kv-heads 2 --head-dim 64
"""
import argparse
import sys

from axonn_jax.mesh import simulate_cpu_devices


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    simulate_cpu_devices(8)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P

    from axonn_jax.analysis import hlo
    from axonn_jax.models import attention
    from axonn_jax.parallel import context

    h, kv, d, t = args.heads, args.kv_heads, args.head_dim, args.seq_len
    x = jax.ShapeDtypeStruct((1, t, h + 2 * kv, d), jnp.float32)

    def stack(attend):
        def layers(x):
            def layer(x, scale):
                y = attend(x[:, :, :h] * scale, x[:, :, h:h + kv] * scale, x[:, :, h + kv:])
                return x.at[:, :, :h].add(y), None
            return jnp.sum(lax.scan(layer, x, jnp.linspace(0.5, 1.0, args.layers))[0])
        return layers

    def compiled(attend, size):
        fn = stack(attend)
        if size:
            mesh = Mesh(np.array(jax.devices()[:size]), ("context",))
            inner = jax.shard_map(lambda x: stack(attend)(x)[None], mesh=mesh,
                                  in_specs=P(None, "context"), out_specs=P("context"))
            fn = lambda x: jnp.sum(inner(x))  # noqa: E731
        return jax.jit(jax.grad(fn)).lower(x).compile()

    one = compiled(lambda q, k, v: attention.causal_attention(q, k, v, "xla"), 0)
    base = one.memory_analysis().temp_size_in_bytes
    print(f"{args.layers} layers, sequence {t}, {h} query / {kv} key-value heads of {d}, fp32, "
          "forward + backward, per device\n")
    print("| scheme | context | FLOPs (compiled) | / block model | collective bytes (compiled) | "
          "/ model | temporary MB | / one device's XLA |\n|---|---|---|---|---|---|---|---|")
    print(f"| one device, XLA | 1 | {hlo.flops(one.as_text()):.3e} | | 0 | | "
          f"{base / 1e6:.1f} | 1.00 |")
    for scheme in context.SCHEMES:
        for size in (1, 2, 4, 8):
            program = compiled(lambda q, k, v: context.attention(q, k, v, scheme=scheme), size)
            text = program.as_text()
            model = args.layers * context.flops((1, t // size, h, d), size)
            sent = sum(hlo.collective_bytes(text).values())
            stated = args.layers * sum(b for _, _, b in context.collectives(
                scheme, (1, t // size, kv, d), jnp.float32, size, q_shape=(1, t // size, h, d)))
            temp = program.memory_analysis().temp_size_in_bytes
            print(f"| {scheme} | {size} | {hlo.flops(text):.3e} | {hlo.flops(text) / model:.3f} | "
                  f"{sent} | {sent / stated if stated else 1:.3f} | {temp / 1e6:.1f} | "
                  f"{temp / base:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
