"""The ResNet-style classifier (`axonn_jax.models.resnet`, preset `resnet-tiny`) through the
trainer: its single-device fp32 trajectory with data, tensor (2D and 3D) parallelism, optimizer
offload and remat; CGX compression tracks it."""
import pytest

from axonn_jax.models import resnet

from conftest import preset_trajectory, relative_difference


def trajectory(devices, grid=None, steps=3, **options):
    """Losses of `steps` steps of the resnet-tiny preset's model and data (no validation)."""
    return preset_trajectory(devices, resnet, "resnet-tiny", grid, steps, **options)


@pytest.fixture(scope="module")
def reference(devices):
    return trajectory(devices)


@pytest.mark.parametrize("grid, options", [
    (dict(data=2, row=2, col=2), dict(offload_optimizer=True)),
    (dict(data=2, depth=2, row=2), dict(remat="offload")),
], ids=["data2_row2_col2-offload", "data2_depth2_row2-remat"])
def test_resnet_trajectory_equals_single_device(reference, devices, grid, options):
    losses = trajectory(devices, grid, **options)
    assert losses[-1] != losses[0]
    assert relative_difference(losses, reference) <= 1e-5


def test_resnet_compressed_tracks_exact(reference, devices):
    losses = trajectory(devices, dict(data=8), compress_bits=8)
    assert 0 < relative_difference(losses, reference) <= 1e-2
