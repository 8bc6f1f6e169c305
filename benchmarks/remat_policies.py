"""What each activation decision keeps and recomputes for one block of a real-size model.

Traces (never compiles or allocates) one block at full size with the KARMA planner's own
`offload.activations.block_cost` and prints, per decision, the device residual bytes in units of
one activation (tokens × d_model in the compute dtype) and the backward's extra matmul FLOPs as a
share of the block's forward:

    python benchmarks/remat_policies.py [--models llama3-8b llama3-70b] [--tokens 4096]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from axonn_jax.models import llama
from axonn_jax.offload import activations


def block_table(name: str, tokens: int) -> dict:
    """`{decision: (activations kept, extra backward FLOPs / forward FLOPs)}` of one bf16 block."""
    config = llama.PRESETS[name]
    block = llama.Block(config, jnp.bfloat16)
    x = jax.ShapeDtypeStruct((1, tokens, config.d_model), jnp.bfloat16)
    params = jax.eval_shape(block.init, jax.random.key(0), x)["params"]
    cost = activations.block_cost(lambda p, h: block.apply({"params": p}, h), params, x,
                                  llama.ACTIVATION_NAMES)
    unit = tokens * config.d_model * 2
    return {d: (cost.device_bytes[d] / unit, cost.extra_flops[d] / cost.forward_flops)
            for d in activations.DECISIONS}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b"])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    print("| model | decision | activations kept on the device | extra backward FLOPs / forward |")
    print("|---|---|---|---|")
    for name in args.models:
        for decision, (kept, extra) in block_table(name, args.tokens).items():
            print(f"| {name} | {decision} | {kept:.2f} | {extra:.3f} |")


if __name__ == "__main__":
    main()
