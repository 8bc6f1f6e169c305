"""CGX quantizer passes: HBM bytes accessed per gradient byte on abstract H100s, and CPU time.

    JAX_PLATFORMS=cpu python benchmarks/bench_quantizer.py [--against REV] [--devices 8]
        [--elements 16777216] [--tensors 4] [--bits 4] [--cpu-elements 4194304] [--repeats 25]

1. `compressed_psum` of `--tensors` float32 gradients (`--elements` in all per device) over
   `data` of `--devices` abstract H100s (`analysis.targets.h100_devices`), compiled deviceless,
   with and without error feedback: HBM bytes the compiled module reads and writes per device
   (`analysis.overlap.hbm_bytes`: compile-only devices give no `cost_analysis()`), divided by the
   gradient's bytes on one device. Reading the gradient (and its residual) and writing the result
   (and the new residual) is 4 passes with error feedback, 2 without; the rest is the quantizer's.
2. Median (and minimum) CPU time of quantize + dequantize of `--cpu-elements` values on one CPU
   device, per gradient byte.

`--against REV` runs both for `parallel/compression.py` as it was at git revision REV too (loaded
beside the current one, so the CPU timings interleave in one process).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def compression_at(rev: str | None):
    """`axonn_jax.parallel.compression`, or its source at git revision `rev` as a module beside it."""
    from axonn_jax.parallel import compression

    if rev is None:
        return compression
    source = subprocess.run(["git", "show", f"{rev}:axonn_jax/parallel/compression.py"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    name = f"axonn_jax.parallel._compression_{rev}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "axonn_jax.parallel"
    sys.modules[name] = module
    exec(compile(source, f"{rev}:compression.py", "exec"), module.__dict__)
    return module


def h100_passes(n: int, elements: int, bits: int, error_feedback: bool, tensors: int = 4,
                C=None) -> float:
    """HBM bytes per gradient byte of the compiled exchange on `n` abstract H100s (see above)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from axonn_jax._compat import shard_map
    from axonn_jax.analysis.overlap import hbm_bytes
    from axonn_jax.analysis.targets import h100_devices

    C = C or compression_at(None)
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
    return hbm_bytes(compiled.as_text()) / (tensors * rows * 1024 * 4)


def cpu_times(modules: dict, elements: int, bits: int, repeats: int) -> dict:
    """{name: (median, min) seconds per gradient byte} of quantize + dequantize, interleaved."""
    import jax

    x = jax.random.normal(jax.random.key(0), (elements // 1024, 1024))
    fns = {name: jax.jit(lambda x, C=C: C.dequantize(C.quantize(x, bits), bits))
           for name, C in modules.items()}
    for f in fns.values():
        jax.block_until_ready(f(x))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(t) / x.nbytes, min(t) / x.nbytes) for name, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default=None, metavar="REV")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--elements", type=int, default=1 << 24, help="gradient elements per device")
    p.add_argument("--tensors", type=int, default=4)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--cpu-elements", type=int, default=1 << 22)
    p.add_argument("--repeats", type=int, default=25)
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    modules = {"now": compression_at(None)}
    if args.against:
        modules = {args.against: compression_at(args.against), **modules}
    for name, C in modules.items():
        for ef in (True, False):
            passes = h100_passes(args.devices, args.elements, args.bits, ef, args.tensors, C)
            print(f"{name}: h100 data={args.devices} bits={args.bits} tensors={args.tensors} "
                  f"error_feedback={ef}: {passes:.2f} gradient passes")
    for name, (med, low) in cpu_times(modules, args.cpu_elements, args.bits,
                                      args.repeats).items():
        print(f"{name}: cpu quantize+dequantize bits={args.bits}: median {med * 1e9:.3f} ns, "
              f"min {low * 1e9:.3f} ns per gradient byte")


if __name__ == "__main__":
    main()
