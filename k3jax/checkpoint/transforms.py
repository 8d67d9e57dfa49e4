"""Per-tensor transforms from a checkpoint tensor to (a slice of) a k3jax parameter.

Each hook knows which stored shapes and dtypes it accepts for a given parameter shape, so shape
errors are found from the headers alone, before any data is read, and can invert itself to write
a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from k3jax.checkpoint.mxfp4 import GROUP
from pallas_kernels.moe_gmm.hopper_mxfp4 import hand_off_order


@dataclass(frozen=True)
class Hook:
    name: str
    expected: Callable[[tuple], tuple]           # the stored shape written for a parameter shape
    accepts: Callable[[tuple, tuple], bool]      # (stored shape, parameter shape) -> ok?
    apply: Callable[[np.ndarray, tuple], np.ndarray]
    invert: Callable[[np.ndarray], np.ndarray]   # parameter -> stored tensor
    stored: str = "float"                        # "float" or "uint8" (MXFP4 parts)
    note: str = ""
    # (box of the parameter, stored shape) -> the box of the stored tensor that `apply` turns into it;
    # None: the hook needs the whole stored tensor.
    region: Callable[[tuple, tuple], tuple] | None = None


def _same_box(box, stored):
    return tuple(box)


def _reversed_box(box, stored):
    return tuple(box)[::-1]


def _conv_box(box, stored):  # param [W, C] box -> stored [C, 1, W] or [C, W] box
    w, c = box
    return (c, slice(None), w) if len(stored) == 3 else (c, w)


def _aligned(s: slice, n: int, what: str) -> None:
    start, stop, _ = s.indices(n)
    if start % GROUP or stop % GROUP:
        raise ValueError(f"{what}: a shard of the hand-off layout must cover whole groups of {GROUP} outputs, "
                         f"got outputs {start}:{stop}")


def _hand_off_codes_box(box, stored):       # param [out, in/2] box -> the same stored box (whole groups of 32)
    _aligned(box[0], stored[0], "expert codes")
    return tuple(box)


def _hand_off_scales_box(box, stored):      # param [in/32, out] box -> stored [out, in/32] box
    _aligned(box[1], stored[0], "expert scales")
    return tuple(box)[::-1]


def _permute(a: np.ndarray, axis: int, inverse: bool = False) -> np.ndarray:
    order = hand_off_order(a.shape[axis])      # each 32 outputs' 16 even ones, then their 16 odd ones
    return np.take(a, np.argsort(order) if inverse else order, axis=axis)


def _exact(expected):
    return lambda stored, shape: tuple(stored) == tuple(expected(shape))


def _conv_accepts(stored, shape):  # param [W, C]; stored [C, 1, W] (HF) or [C, W] (vLLM)
    w, c = shape
    return tuple(stored) in ((c, 1, w), (c, w))


def _a_log_head_accepts(stored, shape):  # param [H]; Kimi-Linear [1, 1, H, 1]; K3 [128] with H = 96
    (h,) = shape
    return tuple(stored) == (1, 1, h, 1) or (len(stored) == 1 and stored[0] >= h)


def _mxfp4_packed_shape(shape):  # param slice [in, out] -> packed [out, in / 2]
    return (shape[1], shape[0] // 2)


def _mxfp4_scale_shape(shape):
    return (shape[1], shape[0] // GROUP)


HOOKS = {
    "copy": Hook("copy", tuple, _exact(tuple), lambda a, s: a, lambda p: p, region=_same_box),
    "transpose": Hook("transpose", lambda s: tuple(s[::-1]), _exact(lambda s: tuple(s[::-1])),
                      lambda a, s: a.T, lambda p: p.T, region=_reversed_box),
    "conv": Hook("conv", lambda s: (s[1], 1, s[0]), _conv_accepts, lambda a, s: a.reshape(s[1], s[0]).T,
                 lambda p: p.T[:, None, :], region=_conv_box),
    "a_log_per_head": Hook("a_log_per_head", lambda s: (1, 1, s[0], 1), _a_log_head_accepts,
                           lambda a, s: a.reshape(-1)[:s[0]], lambda p: p.reshape(1, 1, -1, 1),
                           note="or longer (per_head A_log policy uses the first H entries)"),
    "a_log_per_channel": Hook("a_log_per_channel", tuple, _exact(tuple), lambda a, s: a.reshape(s),
                              lambda p: p, note="(per_channel A_log policy: one entry per key channel)",
                              region=_same_box),
    # MXFP4 experts kept packed: codes [out, in/2] and scales [out, in/32] become their own parameters
    # [in/2, out] and [in/32, out], each a plain transpose of bytes.
    "transpose_uint8": Hook("transpose_uint8", lambda s: tuple(s[::-1]), _exact(lambda s: tuple(s[::-1])),
                            lambda a, s: a.T, lambda p: p.T, "uint8", region=_reversed_box),
    # ... or the codes kept in the stored [out, in/2] orientation ("columns" layout: a plain copy of bytes).
    "copy_uint8": Hook("copy_uint8", tuple, _exact(tuple), lambda a, s: a, lambda p: p, "uint8", region=_same_box),
    # ... or, for the gate and up weights of the "handoff" layout, with their output rows (codes) and columns
    # (scales) reordered within each 32 (`hand_off_order`).
    "copy_uint8_hand_off": Hook("copy_uint8_hand_off", tuple, _exact(tuple), lambda a, s: _permute(a, 0),
                                lambda p: _permute(p, 0, inverse=True), "uint8", region=_hand_off_codes_box),
    "transpose_uint8_hand_off": Hook("transpose_uint8_hand_off", lambda s: tuple(s[::-1]),
                                     _exact(lambda s: tuple(s[::-1])), lambda a, s: _permute(a.T, 1),
                                     lambda p: _permute(p, 1, inverse=True).T, "uint8",
                                     region=_hand_off_scales_box),
    # MXFP4 experts dequantised at load: the packed codes carry the transform; the scales are read alongside them.
    "mxfp4_packed": Hook("mxfp4_packed", _mxfp4_packed_shape, _exact(_mxfp4_packed_shape), None, None, "uint8"),
    "mxfp4_scale": Hook("mxfp4_scale", _mxfp4_scale_shape, _exact(_mxfp4_scale_shape), None, None, "uint8"),
}
