# The two set-up commands of the README. Each creates what it needs on a fresh machine.
.PHONY: demo test venv oracle-venv

PYTEST_ARGS ?=

demo: venv
	.venv/bin/k3jax generate --model tiny-k3 --prompt "def fibonacci(n):" --max-new-tokens 64 --repetition-penalty 1.3 --stream

test: venv oracle-venv
	.venv/bin/python -m pytest -n 2 $(PYTEST_ARGS)

venv:
	@scripts/ensure-venv jax

oracle-venv:
	@scripts/ensure-venv oracle
