"""AxoNN's tensor-parallel grids against GSPMD baselines on 8 devices (simulated CPU devices when no
accelerator is present). Same as `axonn-jax bench`; see `axonn_jax/analysis/gspmd.py`.

    python benchmarks/bench_tp.py --devices 8 --d-model 1024 --out benchmarks/results
"""
import sys

from axonn_jax.run.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
