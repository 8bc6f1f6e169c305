"""Trains one of tests/user_models.py's models as a user's own script would, in one process or as one
process of a job (`axonn-jax launch -- tests/user_train.py ...`, or `mpirun ... --transport mpi`).

    python tests/user_train.py MODEL GRID [--transport mpi] [--microbatches M] --metrics-out F
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=["vit", "regressor"])
    p.add_argument("grid", help="e.g. data=2,row=2,col=2")
    p.add_argument("--transport", default="xla")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--metrics-out", required=True)
    args = p.parse_args()

    import axonn_jax
    from axonn_jax.train import TrainOptions, train

    if args.transport == "xla":
        axonn_jax.init_distributed()  # joins the job `axonn-jax launch` describes
    import user_models as um

    model, data, common = um.setup(args.model)
    options = TrainOptions(**common, parallel=axonn_jax.ParallelConfig.parse(args.grid),
                           transport=args.transport, microbatches=args.microbatches,
                           schedule="1f1b", metrics_out=args.metrics_out)
    train(options, model=model, data=data)


if __name__ == "__main__":
    main()
