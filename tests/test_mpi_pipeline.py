"""The message-driven pipeline over MPI (`mpirun -n S·D ... --transport mpi --pipe S`): any order of
message arrival completes within the stash bound, and mpirun jobs give the single-process trajectory."""
import numpy as np
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.run.cli import main as cli_main
from axonn_jax.transport.mpi_pipeline import permitted, stage_position
from axonn_jax.parallel.pipeline import stage_order
from axonn_jax.train import TrainOptions, train

from conftest import PARITY, assert_steps_match, metrics_file
# The mpirun helpers shared with the other multi-process tests.
from test_distributed import DATA, RUN, STEPS, _mpirun, cli, run, steps_of  # noqa: F401

MODEL = "gpt-tiny-deep"  # 8 layers: 4 per stage for --pipe 2, 2 for --pipe 4


def simulate(schedule, p, m, rng=None, v=1):
    """Run `p` stages' message-driven loops (the engine's rule: the first permitted operation whose
    message is there) against each other. With `rng`, messages are delivered after random delays
    (overtaking each other) and stages act in random order; without, every stage acts once per
    tick on what arrived by the previous tick. Returns each stage's operations in order, the most
    chunk inputs it stashed and the most microbatches it held between forward and W (zb-h1)."""
    done = [{"F": 0, "B": 0, "W": 0} for _ in range(p)]
    inbox = [set() for _ in range(p)]  # delivered messages, as the operation they are for
    in_transit = []  # (stage, operation)
    order, peak, held = [[] for _ in range(p)], [0] * p, [0] * p
    weights = m * v if schedule == "zb-h1" else 0

    def ready(s, op):
        kind, mb, c = op
        j = c * p + s
        local = kind == "W" or (kind == "F" and j == 0) or (kind == "B" and j == p * v - 1)
        return local or op in inbox[s]

    def allowed(s):
        return permitted(schedule, p, m, s, done[s]["F"], done[s]["B"], done[s]["W"], v)

    def act(s):
        """Stage s's next operation, if one is permitted and ready: the messages it sends."""
        op = next((o for o in allowed(s) if ready(s, o)), None)
        if op is None:
            return None
        kind, mb, c = op
        inbox[s].discard(op)
        order[s].append(op)
        done[s][kind] += 1
        peak[s] = max(peak[s], done[s]["F"] - done[s]["B"])
        held[s] = max(held[s], done[s]["F"] - done[s]["W"])
        j = c * p + s
        if kind == "F" and j < p * v - 1:
            return [((s + 1) % p, ("F", mb, (j + 1) // p))]
        if kind == "B" and j > 0:
            return [((s - 1) % p, ("B", mb, (j - 1) // p))]
        return []

    def finished():
        return all(d["B"] == m * v and d["W"] == weights for d in done)

    while not finished():
        if rng is None:
            acted = [act(s) for s in range(p)]
            assert any(a is not None for a in acted), ("deadlock", done)
            for s, op in (msg for a in acted if a for msg in a):
                inbox[s].add(op)
            continue
        if in_transit and rng.random() < 0.5:
            s, op = in_transit.pop(rng.integers(len(in_transit)))
            inbox[s].add(op)
            continue
        in_transit += act(int(rng.integers(p))) or []
        stuck = not in_transit and all(not any(ready(s, o) for o in allowed(s)) for s in range(p))
        assert not stuck or finished(), ("deadlock", done)
    return order, peak, held


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                         ("interleaved-1f1b", 2), ("interleaved-1f1b", 3)])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (3, 5), (4, 2), (4, 8)])
def test_message_driven_loop_completes_within_the_stash_bound(schedule, v, p, m):
    if schedule == "interleaved-1f1b":
        m = p * max(1, m // p)  # microbatches in groups of P
    static = [stage_order(schedule, p, m, s, lockstep=False, virtual_stages=v) for s in range(p)]
    # When every message arrives one tick after it is sent, the loop runs the static schedule.
    order, _, _ = simulate(schedule, p, m, v=v)
    assert [[op for op in ops if op[0] != "W"] for ops in order] == static
    rng = np.random.default_rng(0)
    for _ in range(30):
        order, peak, held = simulate(schedule, p, m, rng, v=v)
        for s in range(p):
            for kind in "FB":  # each kind in the static order, whatever arrived first
                assert [op for op in order[s] if op[0] == kind] == \
                    [op for op in static[s] if op[0] == kind]
            first_backward = next(i for i, op in enumerate(static[s]) if op[0] == "B")
            # 1F1B: stage s holds at most P − s inputs (so at most P); GPipe: all M;
            # interleaved: (V−1)·P + P − s chunk inputs; zb-h1 also at most P until their W.
            assert peak[s] <= (m if schedule == "gpipe" else first_backward)
            if schedule == "1f1b":
                assert peak[s] <= min(p - s, m)
            if schedule == "zb-h1":
                assert held[s] <= p
                assert [op[1] for op in order[s] if op[0] == "W"] == list(range(m))
        if schedule == "gpipe":  # every forward before the first backward
            assert all(ops[:m] == [("F", i, 0) for i in range(m)] for ops in order)


class FakeComm:
    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank

    def Split(self, color, key):
        return (color, key)


def test_stage_position_and_bad_input(capsys):
    position = stage_position(FakeComm(6, rank=5), 3)  # 2 pipelines of 3 stages; rank 5: stage 2 of 1
    assert (position.stage, position.group, position.num_groups, position.last) == (2, 1, 2, True)
    # Split(color, key): the pipeline joins ranks of one group, ordered by stage; and vice versa.
    assert (position.pipe_comm, position.data_comm) == ((1, 2), (2, 1))
    with pytest.raises(ValueError, match="needs a multiple of 4 MPI processes .* got 6"):
        stage_position(FakeComm(6), 4)
    assert cli_main(["train", "--transport", "mpi", "--pipe", "2", "--data-parallel", "1",
                     "--row", "2"]) == 2
    assert "--row/--col/--depth with --transport mpi --pipe > 1 is not implemented yet" in \
        capsys.readouterr().err


@pytest.fixture(scope="module")
def reference(devices):
    """The single-process trajectories (per-step records) on 8 devices, by dtype (computed when
    first asked for)."""
    cache = {}

    def trajectory(dtype="float32"):
        if dtype not in cache:
            summary = train(TrainOptions(model=MODEL, steps=STEPS, batch_size=8, seq_len=16,
                                         eval_batches=1, eval_every=1000, data_path=DATA,
                                         dtype=dtype, parallel=ParallelConfig(data=8), **PARITY),
                            devices=devices)
            cache[dtype] = summary["history"]
        return cache[dtype]

    return trajectory


@pytest.mark.parametrize("nprocs, pipe, schedule, microbatches, extra", [
    (2, 2, "gpipe", 4, ["--dtype", "bfloat16"]),
    (4, 2, "1f1b", 4, []),   # two data-parallel pipelines of two stages; checkpoint and resume
    (2, 2, "zb-h1", 4, []),
    (2, 2, "interleaved-1f1b", 4, ["--virtual-stages", "2"]),  # both kinds of message 1 -> 0
])
def test_mpirun_pipeline_equals_single_process(nprocs, pipe, schedule, microbatches, extra,
                                               reference, tmp_path):
    import mpi4jax  # noqa: F401  (`make test` installs the `mpi` extra: its absence is a failure)

    mpirun = _mpirun()
    assert mpirun, "mpirun not found next to this Python: install the `mpi` extra (make test does)"
    out_file = tmp_path / "m.jsonl"
    job = [mpirun, "-n", str(nprocs), *cli("train", *RUN, "--model", MODEL, "--transport", "mpi",
                                           "--pipe", str(pipe), "--schedule", schedule,
                                           "--microbatches", str(microbatches),
                                           "--metrics-out", str(out_file), *extra)]
    bf16 = "bfloat16" in extra
    if nprocs == 4 and pipe == 2:
        # Each stage's copy in pipeline 0 writes that stage's state; in a fresh job both copies of
        # each stage resume from it.
        ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
        run(job + ckpt + ["--stop-at", "2"])
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["stage-0-of-2", "stage-1-of-2"]
        assert "resumed from step 2" in run(job + ckpt + ["--resume"]).stdout
    else:
        run(job + ["--dump-hlo", str(tmp_path / "hlo")])
        # The dumped program: stage 0's backward, plain XLA (its messages go through host
        # buffers), with bfloat16 matmuls when asked for; zb-h1's B on the first stage has no
        # input gradient to compute: its W does the work.
        hlo = (tmp_path / "hlo" / "train_step.hlo.txt").read_text()
        assert "custom_call_target=\"mpi_" not in hlo
        assert "jit_input_part" in hlo if schedule == "zb-h1" else "dot(" in hlo
        assert ("bf16[" in hlo) == bf16
    expected = reference("bfloat16" if bf16 else "float32")
    # bfloat16: the same training to bfloat16's precision (the single process sums its gradients
    # over 8 devices, the pipeline over microbatches, both rounding in bfloat16).
    assert_steps_match(steps_of(out_file), expected, 2e-2 if bf16 else 1e-5)
    # Most stage inputs held at once by any stage: all M for GPipe, P for 1F1B and ZB-H1 (M > P
    # here), (V−1)·P + P chunk inputs for interleaved 1F1B.
    bound = {"gpipe": microbatches, "interleaved-1f1b": 2 * pipe}.get(schedule, pipe)
    assert {r["stash_peak"] for r in metrics_file(out_file)} == {bound}
    if schedule == "gpipe":  # no choice to make: every operation in the static order
        assert {r["reordered_ops"] for r in metrics_file(out_file)} == {0}
