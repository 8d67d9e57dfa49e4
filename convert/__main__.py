import sys

from k3jax.checkpoint.convert import main
from k3jax.checkpoint.verify import verify_main

if sys.argv[1:2] == ["verify"]:
    sys.exit(verify_main(sys.argv[2:], prog="python -m convert verify"))
sys.exit(main(prog="python -m convert"))
