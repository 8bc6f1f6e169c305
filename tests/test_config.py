import pytest

from axonn_jax import AXES, ParallelConfig, make_mesh
from axonn_jax.config import check_divisible


def test_axes_order_and_shape(devices):
    mesh = make_mesh(ParallelConfig(data=2, pipe=1, depth=1, row=2, col=2))
    assert mesh.axis_names == ("data", "pipe", "expert", "context", "depth", "row", "col") == AXES
    assert dict(mesh.shape) == {"data": 2, "pipe": 1, "expert": 1, "context": 1, "depth": 1,
                                "row": 2, "col": 2}
    # Innermost axis changes fastest across device ids: tensor-parallel groups are contiguous.
    ids = [[d.id for d in row] for row in mesh.devices.reshape(-1, 2)]
    assert ids[0] == [0, 1]


@pytest.mark.parametrize("bad", [{"data": 0}, {"row": -2}, {"col": 1.5}, {"pipe": True}])
def test_non_positive_sizes_are_refused(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"ParallelConfig.{name} must be a positive integer"):
        ParallelConfig(**bad)


def test_product_must_match_device_count(devices):
    with pytest.raises(ValueError, match=r"has 6 devices but 8 are available"):
        make_mesh(ParallelConfig(data=3, row=2))
    with pytest.raises(ValueError, match=r"has 8 devices but 4 are available"):
        make_mesh(ParallelConfig(data=8), devices[:4])


def test_divisibility_error_names_numbers():
    config = ParallelConfig(row=4, col=2)
    check_divisible("d_model", 64, ("row", "col"), config)
    with pytest.raises(ValueError, match=r"d_model = 100 is not divisible by row=4 × col=2 \(= 8\)"):
        check_divisible("d_model", 100, ("row", "col"), config)


def test_parse_grid():
    assert ParallelConfig.parse("data=2, row=4") == ParallelConfig(data=2, row=4)
    with pytest.raises(ValueError, match="bad grid entry"):
        ParallelConfig.parse("rows=4")
