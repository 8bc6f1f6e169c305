"""The offloaded optimizer update run by the host's CPU (`compute_on('device_host')`, as KARMA and
ZeRO-Offload's CPU Adam do) against the update streamed through the device, and XLA:CPU's AdamW
rate per core on this machine.

    python benchmarks/host_update.py [--layers 4] [--elements 16777216] [--out benchmarks/results]

Two parts, written to host_update.json and .md:

1. **XLA:CPU's AdamW here.** `optax.adamw`'s update and `apply_updates` jitted for this machine's
   CPU over `--elements` fp32 masters and moments, a bf16 gradient in and the bf16 parameter
   out (28 B of memory traffic per element), in a fresh process per thread count (XLA:CPU's
   Eigen pool limited to 1 thread, then all cores); beside it numpy's copy rate, the memory
   roofline. Medians of 7 runs after a warm-up.
2. **The update phase alone in a compiled H100 program**, replayed by `analysis.overlap` on
   `h100-dgx`: the parameters of a `--layers`-deep width-4096 GPT (bf16 on one abstract H100,
   its gradients on the device as the backward leaves them), AdamW three ways:
   - `on device`: the state in device memory (`offload.optimizer.on_device`);
   - `streamed through the device`: the state in pinned host memory, each layer's piece copied
     in, updated by the GPU and written back (`offload.optimizer.host_offload`, what
     `--offload-optimizer` runs);
   - `host CPU`: the state in pinned host memory, the gradients copied to the host, AdamW run by
     the host's CPU (XLA's HostExecute), the new bf16 parameters copied back. The replay
     charges a host computation at `Machine.host_compute_bw`, the host memory bandwidth one
     GPU's share of a DGX H100 has; part 1's per-core rate says whether the CPU's arithmetic
     keeps up with it.
   The forward and backward are the same program in all three, so the update's replayed time
   is the whole difference between the steps.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
BYTES_PER_ELEMENT = 28  # fp32 master, mu, nu read and written; bf16 gradient in, parameter out
# A DGX H100's CPU cores per GPU: two 56-core Xeon Platinum 8480C for 8 GPUs (the sources of
# `analysis.comm_model.H100_DGX_HOST_MEMORY_PER_GPU`).
DGX_H100_CORES_PER_GPU = 2 * 56 / 8


def cpu_rate(elements: int, repeats: int = 7) -> dict:
    """AdamW elements per second of XLA:CPU in this process, and numpy's copy bytes per second."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    tx = optax.adamw(1e-4)

    @jax.jit
    def update(grad, master, state):
        updates, state = tx.update(grad.astype(jnp.float32), state, master)
        master = optax.apply_updates(master, updates)
        return master.astype(jnp.bfloat16), master, state

    master = jnp.ones((elements,), jnp.float32)
    state, grad = tx.init(master), jnp.full((elements,), 1e-3, jnp.bfloat16)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        param, master, state = update(grad, master, state)
        jax.block_until_ready(param)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times[1:])
    # The bytes one AdamW pass moves (28 per element), copied once.
    a, b = np.ones(elements * 7, np.float32), np.empty(elements * 7, np.float32)
    copies = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        copies.append(time.perf_counter() - t0)
    return {"elements": elements, "adamw_s": seconds, "elements_per_s": elements / seconds,
            "adamw_bytes_per_s": BYTES_PER_ELEMENT * elements / seconds,
            "copy_bytes_per_s": 2 * a.nbytes / statistics.median(copies)}


def cpu_rates(elements: int) -> list[dict]:
    """`cpu_rate` in a fresh process with XLA:CPU on one thread, then on every core."""
    rows = []
    for threads, flags in ((1, "--xla_cpu_multi_thread_eigen=false "
                               "intra_op_parallelism_threads=1"), (os.cpu_count(), "")):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags,
               "PYTHONPATH": str(REPO)}
        code = (f"import json, sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); "
                f"import host_update; print(json.dumps(host_update.cpu_rate({elements})))")
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout
        rows.append({"threads": threads, **json.loads(out.splitlines()[-1])})
    return rows


def _host_cpu_update(tx, compute_dtype):
    """AdamW by the host's CPU: gradients to host memory, one HostExecute over the whole tree,
    the new parameters back in device memory."""
    import jax
    import optax

    from axonn_jax._compat import compute_on_host

    host, device = jax.memory.Space.Host, jax.memory.Space.Device

    def on_host(grads, master, inner):
        updates, inner = tx.update(grads, inner, master)
        master = optax.apply_updates(master, updates)
        return jax.tree.map(lambda m: m.astype(compute_dtype), master), master, inner

    def apply(grads, opt_state, params):
        grads = jax.device_put(grads, host)
        master, inner = opt_state["master"], opt_state["inner"]
        spaces = (jax.tree.map(lambda _: device, params), jax.tree.map(lambda _: host, master),
                  jax.tree.map(lambda x: host if x.ndim else device, inner))  # Adam's count
        new_params, master, inner = compute_on_host(on_host, spaces)(
            grads, master, jax.device_put(inner, host))
        return new_params, {"master": master, "inner": inner}

    return apply


def update_replays(layers: int) -> list[dict]:
    """The update phase of a `layers`-deep width-4096 GPT on one abstract H100, three ways."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from axonn_jax import ParallelConfig, make_mesh
    from axonn_jax._compat import with_memory_kind
    from axonn_jax.analysis import compiled as cc, overlap, targets
    from axonn_jax.analysis.comm_model import MACHINES
    from axonn_jax.models import gpt
    from axonn_jax.offload import optimizer as offload

    config = gpt.GPTConfig(num_layers=layers, d_model=4096, num_heads=32, max_seq_len=2048,
                           vocab_size=50304)
    model = gpt.stacked(config, jnp.bfloat16)
    tokens = jnp.zeros((1, 2048), jnp.int32)
    master = jax.eval_shape(model.init, jax.random.key(0), {"inputs": tokens, "targets": tokens})
    mesh = make_mesh(ParallelConfig(), targets.h100_devices(1))
    device = NamedSharding(mesh, P())
    host = with_memory_kind(device, "pinned_host")
    tx = optax.adamw(1e-4)
    inner = jax.eval_shape(tx.init, master)
    as_struct = lambda tree, dtype, sharding: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype,
                                       sharding=sharding if x.ndim else device), tree)
    params = grads = as_struct(master, jnp.bfloat16, device)  # bf16, like the parameters
    host_state = {"master": as_struct(master, None, host), "inner": as_struct(inner, None, host)}
    variants = {
        "on device": (offload.on_device(tx).apply, as_struct(inner, None, device)),
        "streamed through the device": (
            offload.host_offload(tx, jnp.bfloat16, layers).apply, host_state),
        "host CPU": (_host_cpu_update(tx, jnp.bfloat16), host_state)}
    rows = []
    for name, (apply, state) in variants.items():
        with jax.set_mesh(mesh):
            # The new state stays where the old one was (a jit's outputs default to device memory).
            placed = jax.tree.map(lambda x: x.sharding, (params, state))
            compiled = jax.jit(apply, donate_argnums=(1, 2), out_shardings=placed) \
                .trace(grads, state, params).lower().compile()
        text = compiled.as_text()
        schedule = overlap.report(text, {}, MACHINES["h100-dgx"])
        links = {k: {"gb": v["bytes"] / 1e9, "s": v["comm_s"], "exposed_s": v["exposed_s"]}
                 for k, v in overlap.summary(schedule.overlaps).items() if "host" in k}
        rows.append({"variant": name, "layers": layers, "jaxlib": jax.__version__,
                     "parameters": sum(x.size for x in jax.tree.leaves(master)),
                     "peak_gb": cc.memory(compiled)["peak"] / 1e9,
                     "host_executes": text.count('custom_call_target="HostExecute"'),
                     "update_s": schedule.step_s, "host": links})
    return rows


def markdown(result: dict) -> str:
    import datetime

    machine = result["machine"]
    lines = ["# The offloaded update on the host's CPU", "",
             f"`python benchmarks/host_update.py --layers {result['layers']}` "
             f"({datetime.date.today()}, jaxlib {result['jaxlib']}); see its docstring.", "",
             f"## XLA:CPU's AdamW on this machine ({machine})", "",
             "| XLA:CPU threads | elements | AdamW s | G elements/s | GB/s of its 28 B/element "
             "| numpy copy GB/s |", "|---|---|---|---|---|---|"]
    for r in result["cpu"]:
        lines.append(f"| {r['threads']} | {r['elements']:,} | {r['adamw_s']:.4f} | "
                     f"{r['elements_per_s'] / 1e9:.3f} | {r['adamw_bytes_per_s'] / 1e9:.2f} | "
                     f"{r['copy_bytes_per_s'] / 1e9:.2f} |")
    lines += ["", f"## The update phase in a compiled H100 program, replayed on `h100-dgx` "
                  f"(host link {result['host_bw'] / 1e9:.0f} GB/s each way, host memory "
                  f"{result['host_compute_bw'] / 1e9:.1f} GB/s per GPU)", "",
              "| update | parameters | HostExecutes | peak GB | replayed update s | "
              "host transfers and computations: GB (s, exposed s) |", "|---|---|---|---|---|---|"]
    for r in result["update"]:
        host = "; ".join(f"{k}: {v['gb']:.2f} ({v['s']:.3f}, {v['exposed_s']:.3f})"
                         for k, v in sorted(r["host"].items())) or "–"
        lines.append(f"| {r['variant']} | {r['parameters'] / 1e9:.2f} B | {r['host_executes']} | "
                     f"{r['peak_gb']:.1f} | {r['update_s']:.3f} | {host} |")
    updates = {r["variant"]: r for r in result["update"]}
    host = updates["host CPU"]
    arithmetic_s = host["parameters"] / (result["cpu"][0]["elements_per_s"]
                                         * DGX_H100_CORES_PER_GPU)
    memory_s = host["host"]["host-compute over host"]["s"]
    streamed_s = updates["streamed through the device"]["update_s"]
    than = "longer" if min(arithmetic_s, memory_s) > streamed_s else "not longer"
    lines += ["", f"At this machine's rate of one core, the {DGX_H100_CORES_PER_GPU:.0f} cores a "
                  f"DGX H100 has per GPU run AdamW over {host['parameters'] / 1e9:.2f} B "
                  f"parameters in {arithmetic_s:.2f} s, against the {memory_s:.2f} s the replay "
                  f"charges for its host memory traffic; either is {than} than the whole update "
                  f"streamed through the device ({streamed_s:.3f} s; on this shared VM the "
                  "one-core rate varies from run to run). A host computation's results do not "
                  "alias its operands, so XLA copies the new state into the state's buffers "
                  "after it (host to host; the replay charges each copy one pass over the link, "
                  "as `host-to-device`)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--elements", type=int, default=1 << 24)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    import platform

    import jax

    from axonn_jax.analysis.comm_model import MACHINES

    machine = MACHINES["h100-dgx"]
    result = {"layers": args.layers, "jaxlib": jax.__version__,
              "machine": f"{platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} cores",
              "host_bw": machine.host_bw, "host_compute_bw": machine.host_compute_bw,
              "cpu": cpu_rates(args.elements), "update": update_replays(args.layers)}
    out = pathlib.Path(args.out)
    (out / "host_update.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "host_update.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
