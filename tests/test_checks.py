"""Every option that takes one of a fixed set of values refuses another the same way."""
import pytest

from axonn_jax.analysis import targets
from axonn_jax.checks import check_choice, collect
from axonn_jax.models import attention
from axonn_jax.offload import activations, precision
from axonn_jax.parallel import compression, context, exchange, pipeline, quantizer
from axonn_jax.step import xla_options
from axonn_jax.tp import tensor


def test_check_choice_returns_the_value_or_names_every_choice():
    assert check_choice("--x", "b", ("a", "b")) == "b"
    assert check_choice("--x", 2, {1: "one", 2: "two"}) == 2
    with pytest.raises(ValueError) as e:
        check_choice("--x", "c", ("a", "b"))
    assert str(e.value) == "--x must be one of a, b, got 'c'"


def test_collect_keeps_each_refusal_and_lets_other_errors_through():
    found = []
    collect(found, check_choice, "--x", "c", ("a", "b"))
    collect(found, check_choice, "--x", "a", ("a", "b"))
    assert found == ["--x must be one of a, b, got 'c'"]
    with pytest.raises(TypeError):
        collect(found, check_choice, "--x")


@pytest.mark.parametrize("check, args, name, choices", [
    (compression.check_rounding, (), "compression rounding", compression.ROUNDINGS),
    (compression.check_scope, (), "compression scope", compression.SCOPES),
    (exchange.check_reduce_dtype, (), "reduce_dtype", exchange.REDUCE_DTYPES),
    (context.check_scheme, (), "context attention scheme", context.SCHEMES),
    (pipeline.schedule_kind, (), "--schedule", pipeline.SCHEDULES),
    (attention.check_implementation, (), "attention implementation", attention.IMPLEMENTATIONS),
    (precision.check_dtype, (), "dtype", precision.DTYPES),
    (activations.check_options, (None,), "--remat", activations.REMAT_MODES),
    (xla_options.check_setting, (), "xla_options", xla_options.CHOICES),
    (targets.target, (), "--target", targets.TARGETS),
    (tensor.collective_matmuls_on, ("cpu", False), "collective_matmul",
     tensor.COLLECTIVE_MATMUL_CHOICES),
    (quantizer.use_kernel, (4, 512), "quantizer impl", quantizer.IMPLS),
])
def test_every_choice_option_refuses_in_the_same_words(check, args, name, choices):
    with pytest.raises(ValueError) as e:
        check("nonsense", *args)
    assert str(e.value) == f"{name} must be one of {', '.join(map(str, choices))}, got 'nonsense'"
