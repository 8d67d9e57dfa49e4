"""Model building blocks (Flax NNX modules). Dimension letters: see k3jax/glossary.md."""
