"""Pipeline schedules: bubble from measured per-stage operation times, activation memory, step time.

    python benchmarks/bench_pipeline.py [--pipe 4] [--data 2] [--rows 2] [--seq-len 64] [--virtual 2]

For M in {P, 2P, 4P, 8P} microbatches of a fixed size (`--rows` sequences each per data shard, so
the batch grows with M) and each schedule — gpipe, 1f1b, interleaved-1f1b with V = `--virtual`
chunks per stage, zb-h1 — it reports:
- published bubble: (P−1)/(M+P−1) for gpipe and 1f1b, (P−1)/(V·M+P−1) interleaved, and for zb-h1
  (P−1)(F+B−W) / (M(F+B+W) + (P−1)(F+B−W)) at the measured costs of a middle stage's forward F,
  input gradient B and weight gradient W;
- measured bubble: 1 − (mean stage busy time) / (step time). On simulated CPU devices all stages
  share the host's cores, so a stage's busy time cannot be read off a wall clock. Instead every
  operation the engine runs is timed on one device (fastest of `--repeats` runs), with the engine's
  own functions (`parallel.pipeline.stage_operations`, and `split_stage_backward` for zb-h1's B
  and W): the forward of the first virtual stage (embedding + its layers) and of any other, the
  backward of the first, a middle and the last (head and loss) one. The schedule's tick table is
  then replayed: the engine synchronizes every tick with a `ppermute`, so a tick lasts as long as
  its slowest stage, and the step lasts the sum of its ticks. Transfers are left out (on one host
  they are memory copies). "even stages" replays the same table with every virtual stage costed
  like a middle one: what the schedule itself leaves idle, to compare with the published bubble;
- activation memory: the stashes the table needs (stage inputs and cotangents, and zb-h1's
  residuals of deferred Ws) in bytes, and the compiled temporary bytes of the whole train step
  (`compiled.memory_analysis()`);
- wall-clock step time of the pipelined step and of the same devices used for data parallelism
  only (same global batch), medians after warm-up; on a shared 2-core host these wall times measure
  total work under contention, not parallel speed.
Results go to benchmarks/results/<name>.json, <name>.md and <name>.png (`--name`, default pipeline).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import median_step_time  # noqa: E402  (benchmarks/timing.py)

KINDS = ("first", "middle", "last")  # virtual stages: embeds / neither / runs the head and loss


def _op_time(fn, *args, repeats: int) -> float:
    """Fastest of `repeats` runs: on a host shared with other jobs, slower runs measure the others."""
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def operation_costs(trainer, rows: int, seq_len: int, repeats: int) -> dict:
    """Seconds per operation of one virtual stage on one microbatch, timed on one device with the
    engine's functions: {"F": {kind: s}, "B": {kind: s}, "W": {kind: s} (split backward only),
    "act_bytes": one stage input, "residual_bytes": one microbatch's W residuals}."""
    import jax
    import jax.numpy as jnp

    from axonn_jax.parallel import pipeline

    o, bound = trainer.options, trainer.bound
    n = pipeline.check_layers(trainer.model.num_layers, o.parallel.pipe, o.pipeline.virtual_stages)
    compute = bound.compute
    embed, stage, head = compute.embed, compute.stage(n), compute.head
    params = bound.fns.init(jax.random.key(0))
    prm = (params["embed"], jax.tree.map(lambda a: a[:n], params["blocks"]), params["head"])
    mb = {"inputs": jnp.zeros((rows, seq_len), jnp.int32),
          "targets": jnp.zeros((rows, seq_len), jnp.int32)}
    x = jax.jit(embed)(prm[0], mb)
    forward, backward = pipeline.stage_operations(embed, stage, head, o.pipeline.microbatches,
                                                  x.dtype)
    flags = {"first": (True, False), "middle": (False, False), "last": (False, True)}
    flags = {k: tuple(jnp.asarray(f) for f in v) for k, v in flags.items()}
    costs = {"F": {k: _op_time(jax.jit(forward), prm, x, mb, flags[k][0], repeats=repeats)
                   for k in ("first", "middle")},
             "act_bytes": x.size * x.dtype.itemsize}
    costs["F"]["last"] = 0.0  # the engine skips it: the backward recomputes it
    if o.pipeline.schedule != "zb-h1":
        costs["B"] = {k: _op_time(jax.jit(backward), prm, x, mb, *flags[k], x, repeats=repeats)
                      for k in KINDS}
        return costs
    split = pipeline.split_stage_backward(backward, (prm, x, mb, *flags["first"], x))
    b, w = jax.jit(split.b), jax.jit(split.w)
    costs["B"], costs["W"] = {}, {}
    for k in KINDS:
        costs["B"][k] = _op_time(b, prm, x, mb, *flags[k], x, repeats=repeats)
        residuals = b(prm, x, mb, *flags[k], x)[2]
        costs["W"][k] = _op_time(w, (prm,), residuals, repeats=repeats)
    costs["residual_bytes"] = sum(r.size * r.dtype.itemsize for r in residuals)
    return costs


def replay(schedule, costs: dict, even: bool = False) -> dict[str, float]:
    """Step time and bubbles of a tick table when every tick lasts as long as its slowest stage:
    each operation costed by its virtual stage's kind (`even`: every one like a middle stage's,
    the last stage's forward included)."""
    import numpy as np

    p, v = schedule.num_stages, schedule.virtual_stages
    stage = np.arange(p)[None, :]
    per_tick = 0.0
    for table, chunks, op in ((schedule.forward, schedule.forward_chunk, "F"),
                              (schedule.backward, schedule.backward_chunk, "B"),
                              (schedule.weight, schedule.weight_chunk, "W")):
        if op not in costs:
            continue
        c = costs[op]
        first, last = (stage == 0) & (chunks == 0), (stage == p - 1) & (chunks == v - 1)
        cost = np.full(table.shape, c["middle"]) if even else \
            np.where(first, c["first"], np.where(last, c["last"], c["middle"]))
        per_tick = per_tick + (table >= 0) * cost
    step = float(per_tick.max(axis=1).sum())
    busy = per_tick.sum(axis=0)
    return {"modeled_step_s": step, "measured_bubble": float(1 - busy.mean() / step),
            "bottleneck_bubble": float(1 - busy.max() / step)}


def published_bubble(schedule, costs: dict) -> float:
    """The published formula; zb-h1's at the measured middle-stage costs."""
    if not schedule.split_backward:
        return schedule.predicted_bubble()
    return schedule.predicted_bubble(costs["F"]["middle"], costs["B"]["middle"],
                                     costs["W"]["middle"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipe", type=int, default=4)
    ap.add_argument("--data", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2, help="sequences per microbatch per data shard")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--model", default="gpt-tiny-deep")
    ap.add_argument("--virtual", type=int, default=2, help="chunks per stage of interleaved-1f1b")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--steps", type=int, default=5,
                    help="timed train steps per configuration (0: compile and replay only)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default="pipeline", help="file name stem of the results")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw the plot and table from the saved <name>.json")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    if args.replot:
        write_report(json.loads((out / f"{args.name}.json").read_text()), out, args.name)
        return 0

    from axonn_jax.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)
    import jax
    import numpy as np

    from axonn_jax import ParallelConfig
    from axonn_jax.parallel.pipeline import make_schedule
    from axonn_jax.train import TrainOptions, build_trainer

    p, d, v = args.pipe, args.data, args.virtual
    devices = jax.devices()[: p * d]
    rng = np.random.default_rng(0)
    results = {"device": f"{len(jax.devices())} simulated CPU devices (host: {jax.devices()[0].device_kind})",
               "command": "python benchmarks/bench_pipeline.py " + " ".join(argv or sys.argv[1:]),
               "pipe": p, "data": d, "virtual": v, "rows_per_microbatch": args.rows,
               "seq_len": args.seq_len, "model": args.model, "operation_costs_s": {}, "rows": []}
    schedules = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", v), ("zb-h1", 1))

    def timed_steps(trainer, batch_size):
        state = trainer.init_state()
        tokens = rng.integers(0, 256, (batch_size, args.seq_len)).astype(np.int32)
        batch = trainer.place({"inputs": tokens, "targets": tokens})
        compiled = trainer.step.lower(state, batch).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        if not args.steps:
            return None, temp
        seconds, _ = median_step_time(compiled, state, batch, args.steps)
        return seconds, temp

    for m in (p, 2 * p, 4 * p, 8 * p):
        batch_size = d * m * args.rows
        common = dict(model=args.model, batch_size=batch_size, seq_len=args.seq_len)
        base = build_trainer(TrainOptions(**common, parallel=ParallelConfig(data=p * d)), devices)
        base_time, base_temp = timed_steps(base, batch_size)
        for name, chunks in schedules:
            options = TrainOptions(**common, parallel=ParallelConfig(data=d, pipe=p),
                                   microbatches=m, schedule=name, virtual_stages=chunks)
            trainer = build_trainer(options, devices)
            key = f"{name}/V={chunks}"
            if key not in results["operation_costs_s"]:
                costs = operation_costs(trainer, args.rows, args.seq_len, args.repeats)
                results["operation_costs_s"][key] = costs
                print(key, "operation costs (ms):",
                      {op: {k: round(t * 1e3, 3) for k, t in c.items()}
                       for op, c in costs.items() if isinstance(c, dict)})
            costs = results["operation_costs_s"][key]
            schedule = make_schedule(name, p, m, chunks)
            step_time, temp = timed_steps(trainer, batch_size)
            stash = (schedule.stash_slots + schedule.cotangent_slots) * costs["act_bytes"]
            residuals = schedule.weight_slots * costs.get("residual_bytes", 0)
            row = {"schedule": name, "virtual_stages": chunks, "microbatches": m,
                   "batch_size": batch_size, "ticks": schedule.num_ticks,
                   "published_bubble": published_bubble(schedule, costs),
                   **replay(schedule, costs),
                   "even_bubble": replay(schedule, costs, even=True)["measured_bubble"],
                   "in_flight": schedule.in_flight, "stash_slots": schedule.stash_slots,
                   "stash_bytes": stash, "residual_slots": schedule.weight_slots if
                   schedule.split_backward else 0, "residual_bytes": residuals,
                   "temp_bytes": temp, "step_time_s": step_time,
                   "no_pipeline_step_time_s": base_time, "no_pipeline_temp_bytes": base_temp}
            results["rows"].append(row)
            print(json.dumps(row))

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    write_report(results, out, args.name)
    return 0


def write_report(results, out: pathlib.Path, name: str) -> None:
    """<name>.png (memory and bubble against M) and <name>.md (the table)."""
    from axonn_jax.parallel.pipeline import make_schedule

    plot(results, out / f"{name}.png")
    p = results["pipe"]
    floor = {}
    for key, costs in results["operation_costs_s"].items():
        sched, chunks = key.split("/V=")
        floor[key] = replay(make_schedule(sched, p, 64 * p, int(chunks)), costs)["measured_bubble"]

    def ms(costs):
        return "; ".join(f"{op} " + ", ".join(f"{k} {t * 1e3:.3f}" for k, t in costs[op].items())
                         for op in ("F", "B", "W") if op in costs)

    lines = [
        f"# Pipeline schedules: pipe={p} × data={results['data']}, {results['model']}, "
        f"{results['rows_per_microbatch']} rows × {results['seq_len']} tokens per microbatch",
        "",
        f"Device: {results['device']}. Command: `{results['command']}`.",
        "",
        "Operation costs per virtual stage (ms, fastest of repeated runs on one device, the engine's "
        "own functions; B is the whole backward with the forward recomputed, except for zb-h1, "
        "whose B is the input gradient and W the weight gradients):",
        "",
        *[f"- {key}: {ms(costs)}" for key, costs in results["operation_costs_s"].items()],
        "",
        "Measured bubble at M = 64P (what stage imbalance and the lockstep ticks leave when the "
        "schedule's own bubble is nearly gone): "
        + ", ".join(f"{k} {b:.3f}" for k, b in floor.items()) + ".",
        "",
        "Columns: published = the formula (zb-h1's at the measured middle-stage F, B, W); measured "
        "= 1 − mean stage busy time / step, replaying the table with the measured operation costs; "
        "even stages = the same with every virtual stage costed like a middle one; bottleneck = 1 − "
        "the busiest stage's busy time / step; in flight = most microbatches a stage holds between "
        "its forward and its last backward operation; replayed step = the step time of that replay; "
        "stash = stage inputs and cotangents the table "
        "keeps, W res = zb-h1's residuals of deferred weight gradients; temp = compiled temporary "
        "bytes of the whole train step per device.",
        "",
        "| schedule | V | M | ticks | published | measured | even stages | bottleneck | replayed step ms "
        "| in flight | stash KiB | W res KiB | temp MiB | step ms | no-pipeline step ms "
        "| no-pipeline temp MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['schedule']} | {r['virtual_stages']} | {r['microbatches']} | {r['ticks']} "
            f"| {r['published_bubble']:.3f} | {r['measured_bubble']:.3f} | {r['even_bubble']:.3f} "
            f"| {r['bottleneck_bubble']:.3f} | {r['modeled_step_s'] * 1e3:.2f} | {r['in_flight']} "
            f"| {r['stash_bytes'] / 1024:.0f} "
            f"| {r['residual_bytes'] / 1024:.0f} | {r['temp_bytes'] / 2**20:.2f} "
            f"| {_ms(r['step_time_s'])} | {_ms(r['no_pipeline_step_time_s'])} "
            f"| {r['no_pipeline_temp_bytes'] / 2**20:.2f} |")
    lines += [
        "",
        "Notes. Bubble: the engine ends every tick with a ppermute, so a tick lasts as long as its "
        "slowest stage. With equal stages the tables leave exactly the published idle time "
        "(tests/test_pipeline.py asserts it for every schedule; for zb-h1 once M ≥ 2P−2 and a W "
        "costs no more than an F or a B): the 'even stages' column is that replay with measured "
        "costs. What the measured column adds is stage imbalance: the first virtual stage also "
        "embeds, the last runs the head and the loss but skips its forward; zb-h1 computes the "
        "embedding's and the head's weight gradients in B (they sit behind the engine's "
        "`lax.cond`), which lengthens the last stage's B. Work: zb-h1's B and W do the FLOPs of the "
        "fused backward (tests/test_pipeline.py), but on this CPU at this size they take longer "
        "(see the operation costs: writing each layer's residuals and a second scan are not free at "
        "d_model = 32), so its replayed step is longer than 1F1B's despite the smaller bubble; "
        "whether the split pays must be measured where matmuls dominate (a GPU). Memory: 1F1B and "
        "zb-h1 keep the same stage "
        "inputs and as many microbatches in flight, but zb-h1's deferred Ws keep their residuals "
        "(each layer's matmul inputs and output cotangents, about 20 activations per layer): "
        "the price of its smaller bubble under this engine, which otherwise recomputes a stage's "
        "forward from its input; interleaving keeps more chunk inputs ((V−1)·P + 2P at most) and "
        "sends V times as many messages. Operation costs are the fastest of a few runs on a shared "
        "host, so they carry its noise. Step times are wall-clock medians on a 2-core host with all "
        "simulated devices on those cores: they measure total work under contention, not parallel "
        "speed.",
    ]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / name}.json, .png and .md")


def _ms(seconds) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_bub) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"gpipe": "o-", "1f1b": "s-", "interleaved-1f1b": "^-", "zb-h1": "D-"}
    for name, style in styles.items():
        rows = [r for r in results["rows"] if r["schedule"] == name]
        if not rows:
            continue
        label = name + (f" V={rows[0]['virtual_stages']}" if rows[0]["virtual_stages"] > 1 else "")
        ms = [r["microbatches"] for r in rows]
        line, = ax_mem.plot(ms, [r["temp_bytes"] / 2**20 for r in rows], style, label=f"{label} temp")
        ax_mem.plot(ms, [(r["stash_bytes"] + r["residual_bytes"]) / 2**20 for r in rows], style,
                    color=line.get_color(), alpha=0.4, label=f"{label} stashes")
        ax_bub.plot(ms, [r["measured_bubble"] for r in rows], style, color=line.get_color(),
                    label=f"{label} measured")
        ax_bub.plot(ms, [r["published_bubble"] for r in rows], "--", color=line.get_color(),
                    alpha=0.6, label=f"{label} published")
    for ax in (ax_mem, ax_bub):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("microbatches M (fixed microbatch size)")
        ax.legend(fontsize=6)
    ax_mem.set_ylabel("MiB per device")
    ax_bub.set_ylabel("bubble fraction")
    fig.suptitle(f"pipe={results['pipe']} data={results['data']}, {results['model']}, "
                 f"{results['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
