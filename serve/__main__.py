import sys

from serve.server import main

sys.exit(main(prog="python -m serve"))
