"""The closeness checks shared by the tests."""

from __future__ import annotations

import numpy as np

# Relative error ||actual - expected|| / ||expected|| allowed by default, per dtype. "tf32": fp32
# data through GPU matrix units (a compiled Triton/Pallas dot rounds its operands to 10-bit
# mantissas; measured 3e-4 on the H200, more after a recurrence compounds it).
TOLERANCES = {"float32": 1e-5, "tf32": 5e-3, "bfloat16": 2e-2, "float16": 2e-3, "float64": 1e-12}


def kernel_dtype(dtype, interpret: bool) -> str:
    """The tolerance class of a Pallas kernel's result: fp32 compiled on a GPU is tf32."""
    name = dtype if isinstance(dtype, str) else str(np.dtype(dtype))
    return "tf32" if name == "float32" and not interpret else name


def xla_dtype(dtype) -> str:
    """The tolerance class of an XLA computation: fp32 dots on a GPU run on TF32 matrix units."""
    import jax  # the tolerance table itself needs no JAX

    name = dtype if isinstance(dtype, str) else str(np.dtype(dtype))
    return "tf32" if name == "float32" and jax.default_backend() == "gpu" else name


def error_ratio(actual, expected) -> float:
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def assert_close(name: str, actual, expected, *, dtype=None, tol: float | None = None) -> float:
    """Asserts `actual` matches `expected`; returns the relative error.

    NaN/Inf in either input fails first. The tolerance is `tol` or the table entry for `dtype`
    (default: actual's dtype). The failure message reports the error ratio and the worst element.
    """
    a_arr, e_arr = np.asarray(actual), np.asarray(expected)
    if dtype not in TOLERANCES:  # a tolerance class ("tf32") or a numpy dtype
        dtype = str(np.dtype(dtype if dtype is not None else a_arr.dtype))
    a = a_arr.astype(np.float64)
    e = e_arr.astype(np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    for label, arr in (("actual", a), ("expected", e)):
        bad = ~np.isfinite(arr)
        assert not bad.any(), f"{name}: {label} has {int(bad.sum())} non-finite values (first at {np.argwhere(bad)[0]})"
    limit = tol if tol is not None else TOLERANCES[dtype]
    err = error_ratio(a, e)
    if not err <= limit:
        i = np.unravel_index(np.argmax(np.abs(a - e)), a.shape)
        ratio = f"{err / limit:.1f}x the tolerance" if limit > 0 else "exact equality required"
        raise AssertionError(f"{name}: relative error {err:.3e} > {limit:.1e} ({ratio}); "
                             f"worst element {i}: {a[i]:.6g} vs expected {e[i]:.6g}")
    return err


def assert_greedy_matches(ours, ref_tokens, ref_logits, min_margin=1e-3):
    """Tokens must agree up to the first step whose HF top-1/top-2 margin is a near-tie."""
    for row in range(ref_tokens.shape[0]):
        top2 = np.sort(ref_logits[row], axis=-1)[:, -2:]
        near_tie = np.flatnonzero(top2[:, 1] - top2[:, 0] < min_margin)
        upto = near_tie[0] if near_tie.size else ref_tokens.shape[1]
        assert upto >= 4, f"row {row}: near-tie at step {upto}; pick another seed for a meaningful check"
        np.testing.assert_array_equal(ours[row, :upto], ref_tokens[row, :upto], err_msg=f"row {row}")
