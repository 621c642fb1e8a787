"""Model FLOPs utilisation: the FLOPs per token a model trains (the numerator) against a
device's peak (the denominator, :mod:`kdist.callbacks.peak`), never reported above 1.

Example:
    >>> from kdist.callbacks.peak import Peak
    >>> flops = ModelFlops(training=1e9, hardware=1e9, remat=False, convention="given")
    >>> utilisation(flops, Peak(1.0, "override", "cpu", "float32"), 500.0)
    {'mfu': 0.5}
    >>> utilisation(flops, Peak(1.0, "override", "cpu", "float32"), 2000.0)["mfu"] is None
    True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from kdist import flops as flops_lib
from kdist.callbacks.peak import Peak


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """Training (model) and hardware FLOPs per token, and the one line saying what was
    counted (logged beside every MFU figure)."""

    training: float
    hardware: float
    remat: bool
    convention: str
    breakdown: flops_lib.FlopsPerToken | None = None

    @classmethod
    def of(cls, model, sequence_length: int, causal_half: bool = True,
           given: float | None = None) -> ModelFlops:
        """The user's figure (``given``), else the model's cost model (any family, yours
        too), else ``6 x trainable parameters``, labelled as such (attention scores are
        then left out).

        Example:
            >>> ModelFlops.of(None, 16, given=1e6).convention
            'given by the user (flops_per_token)'
        """
        if given is not None:
            return cls(float(given), float(given), False, "given by the user (flops_per_token)")
        try:
            counted = flops_lib.model_flops_per_token(model, sequence_length,
                                                      causal_half=causal_half)
        except (TypeError, NotImplementedError):
            parameters = sum(math.prod(w.shape) for w in model.trainable_weights)
            return cls(6.0 * parameters, 6.0 * parameters, False,
                       f"6 x {parameters:,} trainable parameters per token: the model has no "
                       f"cost_model(), so attention's T x T matmuls are not counted")
        return cls(counted.training, counted.hardware, bool(counted.remat),
                   counted.convention, counted)

    def row(self) -> dict:
        """The counts' fields in the run log's config row."""
        return {"flops_per_token": self.training, "hardware_flops_per_token": self.hardware,
                "flops_convention": self.convention,
                "flops_breakdown": self.breakdown.as_dict() if self.breakdown else None}


def utilisation(flops: ModelFlops, peak: Peak, tokens_per_s_per_device: float) -> dict[str, Any]:
    """``mfu`` (and with remat ``hardware_tflops_per_device``, ``hfu``) at a throughput.

    Never above 1: a figure above 1 proves the peak too low (a peak measured on a busy
    machine, or a wrong override), so ``mfu`` (and ``hfu``) are then None and
    ``mfu_unreliable`` says why. A peak already marked unreliable is named there too.
    """
    tflops = tokens_per_s_per_device * flops.training / 1e12
    out: dict[str, Any] = {"mfu": tflops / peak.tflops}
    if flops.remat:
        hardware = tokens_per_s_per_device * flops.hardware / 1e12
        out.update(hardware_tflops_per_device=hardware, hfu=hardware / peak.tflops)
    achieved = max(tflops, out.get("hardware_tflops_per_device", 0.0))
    if achieved > peak.tflops:
        out["mfu"] = None
        if flops.remat:
            out["hfu"] = None
        why = peak.unreliable or f"the {peak.source} figure is wrong"
        out["mfu_unreliable"] = (
            f"{achieved:.4g} TFLOP/s per device exceeds the {peak.source} peak "
            f"{peak.tflops:.4g}, which is too low ({why}); MFU not reported")
    elif peak.unreliable:
        out["mfu_unreliable"] = f"{peak.source} peak: {peak.unreliable}"
    return out


def interval_rates(flops: ModelFlops, peak: Peak, tokens: int, seconds: float, step_times,
                   devices: int, sequence_length: int) -> dict[str, Any]:
    """An interval's rates: tokens/s (global and per device), examples/s, the median and
    p90 of ``step_times`` (seconds per optimizer step), TFLOP/s per device and
    :func:`utilisation`, for ``tokens`` trained in ``seconds`` of steps over ``devices``.

    Example:
        >>> flops = ModelFlops(training=1e9, hardware=1e9, remat=False, convention="given")
        >>> rates = interval_rates(flops, Peak(1.0, "override", "cpu", "float32"), 1000,
        ...                        2.0, [1.0, 1.0], devices=2, sequence_length=10)
        >>> rates["tokens_per_s"], rates["examples_per_s"], rates["mfu"]
        (500.0, 50.0, 0.25)
    """
    tokens_per_s = tokens / seconds
    per_device = tokens_per_s / devices
    return {"tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device,
            "examples_per_s": tokens_per_s / sequence_length,
            "step_time_median_s": float(np.median(step_times)),
            "step_time_p90_s": float(np.percentile(step_times, 90)),
            "tflops_per_device": per_device * flops.training / 1e12,
            **utilisation(flops, peak, per_device)}


def shown_mfu(row: dict[str, Any]) -> float | None:
    """The MFU the progress bar shows for an interval row: only a figure to trust — none
    above 1 and none against a peak that is itself unreliable (measured under load), whose
    figures stay in the run log beside ``mfu_unreliable``.

    Example:
        >>> shown_mfu({"mfu": 0.5}), shown_mfu({"mfu": 0.5, "mfu_unreliable": "busy"})
        (0.5, None)
    """
    if row.get("mfu") is None or row.get("mfu_unreliable"):
        return None
    return round(row["mfu"], 4)
