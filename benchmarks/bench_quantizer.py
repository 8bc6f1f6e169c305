"""CGX quantizer passes: HBM bytes accessed per gradient byte on abstract H100s, and CPU time.

    JAX_PLATFORMS=cpu python benchmarks/bench_quantizer.py [--devices 8] [--elements 16777216]
        [--bits 4] [--cpu-elements 4194304] [--repeats 20]

1. `compressed_psum` (error feedback on) of one float32 gradient over `data` of `--devices`
   abstract H100s (`analysis.targets.h100_devices`), compiled deviceless; the compiled module's
   `cost_analysis()['bytes accessed']` per device divided by the gradient's bytes on one device:
   how many passes over the gradient the quantize + exchange + dequantize costs (reading the
   gradient and its residual, writing the result and the new residual is 4 passes of an ideal
   fused error-feedback exchange; 2 without error feedback).
2. Median CPU time of quantize + dequantize of one shard (one simulated CPU device), per byte.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def h100_passes(n: int, elements: int, bits: int, error_feedback: bool, tensors: int = 4) -> float:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from axonn_jax._compat import shard_map
    from axonn_jax.analysis.overlap import hbm_bytes
    from axonn_jax.analysis.targets import h100_devices
    from axonn_jax.parallel import compression as C

    mesh = Mesh(h100_devices(n), ("data",))
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
    lead = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731

    def with_feedback(g, r):
        out, res = C.compressed_psum(first(g), "data", bits=bits, residual=first(r))
        return out, lead(res)

    def without(g):
        return C.compressed_psum(first(g), "data", bits=bits)[0]

    rows = elements // tensors // 1024
    spec = {f"w{i}": jax.ShapeDtypeStruct((n, rows, 1024), jnp.float32,
                                          sharding=NamedSharding(mesh, P("data")))
            for i in range(tensors)}
    if error_feedback:
        f = shard_map(with_feedback, mesh=mesh, in_specs=(P("data"), P("data")),
                      out_specs=(P(), P("data")))
        compiled = jax.jit(f).trace(spec, spec).lower().compile()
    else:
        f = shard_map(without, mesh=mesh, in_specs=(P("data"),), out_specs=P())
        compiled = jax.jit(f).trace(spec).lower().compile()
    # Compile-only devices give no cost analysis: count the scheduled module's kernels instead.
    return hbm_bytes(compiled.as_text()) / (tensors * rows * 1024 * 4)


def cpu_time_per_byte(elements: int, bits: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    from axonn_jax.parallel import compression as C

    x = jax.random.normal(jax.random.key(0), (elements // 1024, 1024))
    f = jax.jit(lambda x: C.dequantize(C.quantize(x, bits), bits))
    jax.block_until_ready(f(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / (elements * 4)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--elements", type=int, default=1 << 24, help="gradient elements per device")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--cpu-elements", type=int, default=1 << 22)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for ef in (True, False):
        passes = h100_passes(args.devices, args.elements, args.bits, ef)
        print(f"h100 data={args.devices} bits={args.bits} error_feedback={ef}: "
              f"{passes:.2f} gradient passes (bytes accessed / gradient bytes)")
    ns = cpu_time_per_byte(args.cpu_elements, args.bits, args.repeats) * 1e9
    print(f"cpu quantize+dequantize bits={args.bits}: {ns:.3f} ns per gradient byte "
          f"({1 / ns:.2f} GB/s)")


if __name__ == "__main__":
    main()
