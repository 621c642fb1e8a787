"""Numpy references of kdist.precision's quantizers and quantized products, written from the
definitions (docs/precision.md), not from the JAX code: float32 scales, round half to even,
exact integer accumulation (int64 here, which int32 equals while no sum overflows it)."""

import ml_dtypes
import numpy as np


def int8(x, axis):
    """Codes and float32 scales: max |x| over ``axis`` x float32(1/127) (1 where 0)."""
    x = np.asarray(x, np.float32)
    peak = np.max(np.abs(x), axis=axis, keepdims=True)
    scale = np.where(peak > 0, peak * np.float32(1 / 127), np.float32(1)).astype(np.float32)
    return np.clip(np.round(x * (np.float32(1) / scale)), -127, 127).astype(np.int8), scale


def int8_product(a, b):
    """``a (M, K) @ b (K, N)``: a per row, b per column, exact integer sums, rescaled."""
    qa, sa = int8(a, 1)
    qb, sb = int8(b, 0)
    acc = qa.astype(np.int64) @ qb.astype(np.int64)
    assert np.abs(acc).max() < 2**31  # what int32 accumulation holds exactly
    return acc.astype(np.float32) * sa * sb


def fp8(x, axis, dtype):
    """Float8 codes (as float32 values) and float32 scales: max |x| / the format's max."""
    x = np.asarray(x, np.float32)
    largest = float(ml_dtypes.finfo(dtype).max)
    peak = np.max(np.abs(x), axis=axis, keepdims=True)
    scale = np.where(peak > 0, peak * np.float32(1 / largest), np.float32(1)).astype(np.float32)
    codes = np.clip(x * (np.float32(1) / scale), np.float32(-largest), np.float32(largest))
    return codes.astype(dtype).astype(np.float32), scale


def fp8_product(a, b, dtype_a, dtype_b):
    """``a @ b`` on float8 codes, summed in float64 (the float32 sum is within its rounding)."""
    qa, sa = fp8(a, 1, dtype_a)
    qb, sb = fp8(b, 0, dtype_b)
    return (qa.astype(np.float64) @ qb.astype(np.float64)) * sa * sb


def int8_rounding_bound(a, b, steps_a=0.5, steps_b=0.5):
    """The most ``int8_product(a, b)`` can differ from ``a @ b``: each code is within half
    a scale of its value, so entry (m, n) is off by at most
    ``e_a[m] sum_k |b[k, n]| + e_b[n] sum_k |a[m, k]| + K e_a[m] e_b[n]`` (e: half scales),
    plus the float32 rescale's rounding. ``steps_a``/``steps_b``: the codes' error in
    scales instead of half of one (1 for stochastic rounding: floor or ceiling)."""
    _, sa = int8(a, 1)
    _, sb = int8(b, 0)
    ea, eb = steps_a * sa.astype(np.float64), steps_b * sb.astype(np.float64)
    abs_a, abs_b = np.abs(a).astype(np.float64), np.abs(b).astype(np.float64)
    bound = ea * abs_b.sum(0, keepdims=True) + eb * abs_a.sum(1, keepdims=True)
    return bound + a.shape[1] * ea * eb + 1e-6 * np.abs(a.astype(np.float64) @ b)
