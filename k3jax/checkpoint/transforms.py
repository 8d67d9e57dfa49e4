"""Per-tensor transforms from a checkpoint tensor to (a slice of) a k3jax parameter.

Each hook knows which stored shapes it accepts for a given parameter shape, so shape errors are
found from the headers alone, before any data is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Hook:
    name: str
    source_shapes: Callable[[tuple], list[tuple]]  # accepted stored shapes for a parameter shape
    apply: Callable[[np.ndarray, tuple], np.ndarray]


def _copy_shapes(shape):
    return [tuple(shape)]


def _transpose_shapes(shape):
    return [tuple(shape[::-1])]


def _conv_shapes(shape):  # param [W, C]; stored [C, 1, W] (HF) or [C, W] (vLLM)
    w, c = shape
    return [(c, 1, w), (c, w)]


def _conv_apply(arr, shape):
    w, c = shape
    return arr.reshape(c, w).T


def _a_log_shapes(shape):  # param [H]; Kimi-Linear stores [1, 1, H, 1]
    (h,) = shape
    return [(1, 1, h, 1), (h,)]


HOOKS = {
    "copy": Hook("copy", _copy_shapes, lambda a, s: a),
    "transpose": Hook("transpose", _transpose_shapes, lambda a, s: a.T),
    "conv": Hook("conv", _conv_shapes, _conv_apply),
    "a_log": Hook("a_log", _a_log_shapes, lambda a, s: a.reshape(s)),
}
