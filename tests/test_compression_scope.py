"""CGX's `--compress-scope inter-node`: exact inside each node, compressed between nodes; the 8
simulated devices stand in for 2 nodes of 4 (or 4 of 2) through `--compress-node-size`."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.analysis import comm_model as cm, targets
from axonn_jax.analysis.hlo import bytes_by_axes, collectives
from axonn_jax.parallel import compression as C
from axonn_jax.run.cli import main as cli_main
from axonn_jax.step.train_step import StepOptions, option_problems
from axonn_jax.train import TrainOptions, build_trainer

from conftest import assert_steps_match
from test_compression import data_mesh, run_psum as psum_over  # noqa: F401 (fixture)
from test_compression_tp import OPTS, assert_tracks, corpus, run  # noqa: F401 (fixture)

B = 64




@pytest.mark.parametrize("node_size", [2, 4])
def test_inter_node_psum_within_bound_of_node_sums(data_mesh, node_size):
    """Each node's sum is exact, so the result is off by the quantization of `8 / node_size`
    node sums and their re-quantized sum; each residual is nonzero only on the chunk its shard
    quantized, and the residuals of a node add up to what the node's sum lost; 1-D tensors
    stay exact."""
    n, nodes, bits = 8, 8 // node_size, 4
    keys = jax.random.split(jax.random.key(7), 2)
    tree = {"w": jax.random.normal(keys[0], (n, 6, 50)), "b": jax.random.normal(keys[1], (n, 70))}
    residual = jax.tree.map(lambda a: 0.05 * jnp.sin(a), tree)
    out, new_r = psum_over(data_mesh, tree, residual, bits=bits, bucket_size=B, min_size=100,
                           node_size=node_size)
    x = jax.tree.map(lambda a, r: np.asarray(a + r, np.float64), tree, residual)
    np.testing.assert_allclose(out["b"], x["b"].sum(0), rtol=1e-5)
    assert not np.any(np.asarray(new_r["b"]))
    flat = x["w"].reshape(nodes, node_size, -1).sum(1)  # [nodes, 300]: the exact node sums
    chunk = -(-flat.shape[1] // node_size)
    r = np.asarray(new_r["w"], np.float64).reshape(nodes, node_size, -1)
    for k in range(node_size):  # shard k of a node holds the error of chunk k only
        outside = np.delete(r[:, k], np.s_[k * chunk:(k + 1) * chunk], axis=1)
        assert not np.any(outside)
    sent = flat - r.sum(1)  # what each node's shards quantized: its sum minus its residuals
    scale = lambda v: (np.ptp(v) if v.size else 0) / (2 ** bits - 1)  # noqa: E731
    bound = np.zeros(flat.shape[1])
    for k in range(node_size):  # buckets are cut from each chunk
        for s in range(k * chunk, min((k + 1) * chunk, flat.shape[1]), B):
            e = min(s + B, (k + 1) * chunk, flat.shape[1])
            bound[s:e] = sum(scale(f[s:e]) for f in flat) / 2 + scale(sent.sum(0)[s:e]) / 2
    err = np.abs(np.asarray(out["w"], np.float64).ravel() - flat.sum(0))
    assert np.all(err <= bound + 1e-5 * np.abs(x["w"]).sum(0).ravel())
    assert err.max() > 0  # it was quantized
    mean, _ = psum_over(data_mesh, tree, residual, bits=bits, bucket_size=B, min_size=100,
                        node_size=node_size, mean=True)
    np.testing.assert_allclose(np.asarray(mean["w"]) * n, out["w"], rtol=1e-5, atol=1e-6)


def test_inter_node_gather_without_a_free_axis_equals_the_grouped_one(devices, data_mesh):
    """On a mesh of `data` alone no shard_map can nest inside the exchange, so the packed result
    is gathered over the whole axis and reordered (`compression._by_place`): the same values and
    residuals as the gathers across nodes and then inside them."""
    from jax.sharding import Mesh

    keys = jax.random.split(jax.random.key(5), 2)
    tree = {"w": jax.random.normal(keys[0], (8, 6, 50)), "b": jax.random.normal(keys[1], (8, 70))}
    residual = jax.tree.map(lambda a: 0.05 * jnp.cos(a), tree)
    alone = Mesh(np.asarray(devices), ("data",))
    runs = [psum_over(mesh, tree, residual, bits=4, bucket_size=B, min_size=100, node_size=2)
            for mesh in (alone, data_mesh)]
    for got, want in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_inter_node_stochastic_rounding_follows_the_key(data_mesh):
    """Stochastic rounding between nodes: unbiased noise from the key (two keys, two results),
    each within twice the nearest-rounding steps of the node sums and their sum."""
    tree = {"w": jax.random.normal(jax.random.key(2), (8, 4, 64))}
    zeros = jax.tree.map(jnp.zeros_like, tree)
    outs = [np.asarray(psum_over(data_mesh, tree, zeros, bits=4, bucket_size=B, min_size=1,
                                 node_size=4, key=jax.random.key(k))[0]["w"]) for k in range(2)]
    nodes = np.asarray(tree["w"], np.float64).reshape(2, 4, -1).sum(1)
    step = sum(np.ptp(f) for f in nodes) / 15 + np.ptp(nodes.sum(0)) * 2 / 15
    for out in outs:
        assert np.abs(out.ravel() - nodes.sum(0)).max() <= 2 * step
    assert np.any(outs[0] != outs[1])


def test_residuals_are_laid_out_alike_under_both_scopes(devices):
    """The error-feedback state has the same shapes and placement under scope all and
    inter-node, so a checkpoint of one restores (and reshards) under the other."""
    states = [build_trainer(TrainOptions(parallel=ParallelConfig(data=4, row=2), compress_bits=4,
                                         compress_scope=scope, compress_node_size=4),
                            devices).init_state(abstract=True).reducer
              for scope in ("all", "inter-node")]
    for a, b in zip(*(jax.tree.leaves(s) for s in states)):
        assert a.shape == b.shape and a.sharding.is_equivalent_to(b.sharding, len(a.shape))


SCOPED = dict(compress_bits=8, compress_scope="inter-node")


@pytest.mark.parametrize("grid, node_size", [(dict(data=8), 2), (dict(data=4, row=2), 4)],
                         ids=["data8-4-nodes-of-2", "data4-row2-2-nodes-of-2-shards"])
def test_inter_node_8bit_tracks_exact_trajectory(devices, corpus, grid, node_size):  # noqa: F811
    """8 bits between nodes tracks the exact step within the bounds 8 bits over all devices
    keeps to (`assert_tracks`), each layer exchanged inside the backward; the residuals keep the
    parameters' shapes, split over data; exchanged after the backward, the same losses. (A
    node's sum spans a wider range than one device's gradient, so its buckets round coarser than
    under scope all: docs/modes/compression.md gives the distances.)"""
    grid = ParallelConfig(**grid)
    exact = run(TrainOptions(**OPTS, parallel=grid), devices, corpus)
    got = run(TrainOptions(**OPTS, parallel=grid, compress_node_size=node_size, **SCOPED),
              devices, corpus)
    assert_tracks(got, exact)
    trainer, state = got[2], got[1]
    assert trainer.bound.engine.exchanges_layers
    for p, r in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.reducer)):
        assert r.shape == (grid.data, *p.shape)
    assert any(np.any(np.asarray(r)) for r in jax.tree.leaves(state.reducer))
    if grid.row == 1:  # the after-backward exchange rounds every bucket the same way
        after = run(TrainOptions(**OPTS, parallel=grid, compress_node_size=node_size,
                                 compress_in_backward=False, **SCOPED), devices, corpus)
        assert not after[2].bound.engine.exchanges_layers
        assert_steps_match(got[0], after[0], 1e-6)


def test_scope_from_yaml_and_checks(tmp_path):
    """`compression.scope` and `compression.node_size` from YAML; a scope outside `SCOPES` and
    inter-node between processes (MPI) are refused."""
    from axonn_jax.run import config as run_config

    path = tmp_path / "c.yaml"
    path.write_text("compression:\n  bits: 4\n  scope: inter-node\n  node_size: 4\n")
    c = run_config.load_file(path).compression
    assert (c.scope, c.node_size) == ("inter-node", 4)
    with pytest.raises(ValueError, match="--compress-scope must be one of all, inter-node"):
        TrainOptions(compress_bits=4, compress_scope="nodes")
    found = option_problems(ParallelConfig(data=2),
                            StepOptions(compress_bits=4, compress_scope="inter-node"),
                            between_processes=True)
    assert found == ["compress_scope=inter-node between processes (--transport mpi) is not "
                     "implemented yet"]


def test_inter_node_bytes_match_model_and_compiled_hlo(devices):
    """gpt-tiny, data=8 as 2 nodes of 4, 4 bits: per (kind, axes) the compiled step's wire bytes
    are the model's within 5%: an exact reduce-scatter inside each node, the packed chunks'
    all-to-all between nodes, the packed result's all-gather and the exact tensors' all-reduce
    over data; and the all-to-all sends a quarter of scope all's."""
    from axonn_jax.run.plan import workload

    found = {}
    for scope in ("all", "inter-node"):
        options = TrainOptions(model="gpt-tiny", batch_size=16, seq_len=32,
                               parallel=ParallelConfig(data=8), compress_bits=4,
                               compress_scope=scope, compress_node_size=4)
        trainer = build_trainer(options, devices)
        state = trainer.init_state(abstract=True)
        text = trainer.step.lower(state, trainer.bound.abstract_batch()).compile().as_text()
        grid = options.parallel
        measured = bytes_by_axes(text, grid.as_dict())
        predicted = cm.bytes_by_axes(workload(options, "cpu"), grid)
        for key in set(measured) | set(predicted):
            got, want = measured.get(key, 0.0), predicted.get(key, 0.0)
            assert abs(got - want) <= max(0.05 * got, 64), (scope, key, got, want)
        found[scope] = measured
        if scope == "inter-node":  # the packed result gathered across the 2 nodes, then inside
            sizes = sorted({c.group_size for c in collectives(text) if c.kind == "all-gather"})
            assert sizes == [2, 4], sizes
    inter, flat = found["inter-node"], found["all"]
    assert inter[("reduce-scatter", ("data",))] > 0
    assert inter[("all-to-all", ("data",))] == pytest.approx(
        flat[("all-to-all", ("data",))] / 4 / (7 / 8) * (1 / 2), rel=0.05)


@pytest.mark.parametrize("argv, message", [
    (["--compress-scope", "inter-node"], "--compress-scope needs gradient compression"),
    (["--compress-bits", "4", "--compress-scope", "nodes"], "invalid choice"),
    (["--compress-bits", "4", "--compress-scope", "inter-node", "--data-parallel", "8"],
     "data=8 fits in one node of 8 devices"),
    (["--compress-bits", "4", "--compress-scope", "inter-node", "--data-parallel", "8",
      "--compress-node-size", "3"], "do not split data=8"),
])
def test_cli_bad_scope_flags(argv, message, capsys):
    try:
        code = cli_main(["train", "--steps", "1", *argv])
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(targets.cuda_compile_problem() is not None, reason="no CUDA compile plugin")
def test_h100_compile_reports_each_link(capsys):
    """Compiled for 16 abstract H100s (2 nodes of 8, the default node size on GPUs), data 16, 4
    bits: the replay puts the exact reduce-scatter on the intra-node link, the all-to-all on the
    inter-node one and the final all-gather on both (across nodes, then inside; `by_link`), and
    the compiled bytes per kind are the model's."""
    assert cli_main(["compile", "--target", "h100", "--devices", "16", "--dp", "16",
                     "--model", "gpt-tiny", "--batch-size", "16", "--seq-len", "64",
                     "--compress-bits", "4", "--compress-scope", "inter-node",
                     "--overlap-report", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    def links(kind):
        return {key.split(" on ")[1] for key in report["overlap"]["by_link"]
                if key.startswith(f"{kind} over data")}
    assert links("reduce-scatter") == {"intra-node"}
    assert links("all-to-all") == {"inter-node"}
    assert links("all-gather") == {"inter-node", "intra-node"}  # across nodes, then inside
    assert report["comm_bytes_per_device"] == pytest.approx(
        report["predicted"]["comm_bytes_per_device"], rel=0.05, abs=64)


def test_processes_stand_in_for_nodes(tmp_path):
    """`launch` of 2 processes of 4 CPU devices, data 8, 8 bits, scope inter-node with the
    default node size (a process's devices): the steps of one process of 8 devices with
    `--compress-node-size 4`, so each process is a node (exact inside it, compressed between)."""
    from test_distributed import RUN, cli, run, steps_of

    args = [*RUN, "--compress-bits", "8", "--compress-scope", "inter-node"]
    run(cli("launch", "--nprocs", "2", "--devices-per-proc", "4", "--log-dir",
            str(tmp_path / "logs"), "--", "train", *args, "--metrics-out",
            str(tmp_path / "two.jsonl")))
    run(cli("train", "--devices", "8", *args, "--compress-node-size", "4", "--metrics-out",
            str(tmp_path / "one.jsonl")))
    # Programs of 4 and 8 devices add in different orders: fp32 roundings (about 1e-6 of the
    # first gradient norm) pass through the 8-bit quantizer's own rounding and grow in the
    # norms (3.5e-5 by the fourth step on one CPU, under 1e-5 on another).
    assert_steps_match(steps_of(tmp_path / "two.jsonl"), steps_of(tmp_path / "one.jsonl"),
                       norm_rtol=1e-4)
