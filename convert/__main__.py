import sys

from k3jax.checkpoint.convert import main

sys.exit(main(prog="python -m convert"))
