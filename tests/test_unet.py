"""The diffusion U-Net (`axonn_jax.models.unet`) through the trainer as the `unet-tiny` preset:
its single-device trajectory on tensor-parallel grids with offload, the pipeline and remat; the
analytic parameter count; clear errors."""
import jax
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.models import get, unet

from conftest import assert_learns, assert_states_match, assert_steps_match, preset_trajectory

# The loss of the repeated batch after two updates, at most this fraction of the first (measured
# 0.53).
LEARNS = 0.75


def trajectory(devices, grid=None, steps=3, **options):
    """Summary (`history`, `state`) of `steps` steps of the unet-tiny preset's model on one of
    its batches, repeated (no validation)."""
    return preset_trajectory(devices, unet, "unet-tiny", grid, steps, **options)


@pytest.fixture(scope="module")
def reference(devices):
    ref = trajectory(devices)
    assert_learns(ref["history"], LEARNS)  # the same batch, two updates later
    return ref


@pytest.mark.parametrize("grid, options", [
    (dict(data=2, row=2, col=2), dict(offload_optimizer=True)),
    (dict(pipe=2, data=4), dict(microbatches=2, remat="full")),
    (dict(pipe=2, row=2, col=2), dict(microbatches=2)),
    (dict(pipe=2, depth=2, row=2), dict(microbatches=2, schedule="zb-h1")),
], ids=["data2_row2_col2-offload", "pipe2_data4-remat", "pipe2_row2_col2", "pipe2_depth2_row2-zb"])
def test_unet_trajectory_equals_single_device(reference, devices, grid, options):
    got = trajectory(devices, grid, **options)
    assert_steps_match(got["history"], reference["history"])
    assert_states_match(got["state"], reference["state"])


def test_unet_shape_and_errors():
    for name in ("unet-tiny", "unet-28b"):
        config = unet.PRESETS[name]
        shapes = jax.eval_shape(unet.stacked(config).init, jax.random.key(0),
                                config.example_batch(2))
        assert sum(x.size for x in jax.tree.leaves(shapes)) == config.num_params()
    assert 27e9 < unet.PRESETS["unet-28b"].num_params() < 29e9
    with pytest.raises(ValueError, match="num_heads = 4 is not divisible by row=8"):
        get("unet-tiny").check_grid(ParallelConfig(row=8))
    with pytest.raises(ValueError, match="image_size = 9 is not divisible by 2"):
        unet.UNetConfig(num_layers=1, channels=8, image_size=9)


def test_plan_ranks_unet_grids():
    from axonn_jax.analysis import comm_model as cm

    config = unet.PRESETS["unet-28b"]
    layouts = cm.conv_layouts(config)  # parallelize's own trace: the blocks alternate
    assert [layouts[n] for n in ("res/conv1", "res/time1", "res/time2", "res/conv2")] == \
        [False, True, False, True]
    assert [layouts[f"attn/{n}"] for n in ("query", "key", "value", "out")] == [False] * 3 + [True]
    ranked = cm.plan(cm.Workload(config, 64, 1), 64, cm.MACHINES["h100-dgx"])
    assert len(ranked) > 5 and ranked[0].step_time_s <= ranked[-1].step_time_s
    assert any(p.grid.row * p.grid.col > 1 for p in ranked[:3])
    grid = ranked[0].grid
    assert cm.parameters_per_device(cm.Workload(config, 64, 1), grid) < config.num_params() / 8
