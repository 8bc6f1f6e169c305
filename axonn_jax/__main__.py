"""`python -m axonn_jax ...` is `axonn-jax ...`."""
import sys

from .run.cli import main

sys.exit(main())
