"""Kernel test matrices: interpret mode on the CPU runs the rows that bring something new, a GPU runs them all.

A kernel case in interpret mode costs a compile of one to three seconds on the CPU, and the long matrices (every
form of a kernel against its reference, on several shapes and inputs) were a large part of the suite's time. The
rows a test lists are its whole matrix. `covering_rows` keeps, in interpret mode, each row that brings a feature
no earlier row brought (a form, an option, a shape, a gate range, a dtype, or a combination a test names as one
feature: whatever `features` gives) and each row `keep` asks for. Each other row combines features that earlier
rows ran one at a time, and is skipped with that reason: combinations not named as features go untested on the
CPU. Every row runs compiled on a GPU (K3JAX_TEST_DEVICE=gpu), and in interpret mode with K3JAX_FULL_MATRIX=1.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterable, Sequence

import pytest

FULL_MATRIX = os.environ.get("K3JAX_TEST_DEVICE") == "gpu" or os.environ.get("K3JAX_FULL_MATRIX") == "1"
COVERED = ("interpret mode: each feature of this row is brought by an earlier row (their combination is not); "
           "the whole matrix runs compiled on a GPU and with K3JAX_FULL_MATRIX=1")


def covering_rows(rows: Sequence, features: Callable[..., Iterable[Hashable]],
                  keep: Callable[..., bool] = lambda *row: False) -> list:
    """rows, each as `pytest.param`: those that bring a new feature (features(*row)) or that keep(*row) asks for
    run everywhere, the others only where FULL_MATRIX holds. A row is a tuple of the test's arguments, or one
    value for a single argument."""
    seen: set = set()
    out = []
    for row in rows:
        if isinstance(row, type(pytest.param())):
            raise TypeError("covering_rows takes plain rows (tuples or single values), not pytest.param")
        values = row if isinstance(row, tuple) else (row,)
        brought = set(features(*values))
        runs = FULL_MATRIX or not brought <= seen or keep(*values)
        seen |= brought
        out.append(pytest.param(*values, marks=() if runs else pytest.mark.skip(reason=COVERED)))
    return out
