"""The coverage report: every weight of a model with its layout, bytes per device and the
rule that chose it (declared logical axes, auto-sharding, or replicated because small)."""

from __future__ import annotations

import math

import numpy as np

from kdist.parallel import auto, rules
from kdist.parallel.layout import active


def coverage_report(model, dist=None) -> tuple[list[dict], str]:
    """Every weight of ``model`` with its shape, mesh axes, rule and bytes per device.

    ``dist`` defaults to the active distribution. Returns ``(rows, text)``.

    Example:
        >>> rows, text = coverage_report(model)  # doctest: +SKIP
        >>> print(text)  # doctest: +SKIP
    """
    dist = dist or active()
    rows = []
    for v in model.weights:
        shape = tuple(v.shape)
        layout = dist.get_variable_layout(v)
        axes = tuple(layout.axes) if layout is not None else (None,) * len(shape)
        if rules.declared_axes(v) is not None:
            rule = "declared logical axes"
        elif getattr(dist, "auto_shard", False):
            rule = auto.infer_axes(v.path, shape, dist.mesh_shape,
                              allow_replicated=dist.allow_replicated)[1]
        else:
            rule = "replicated (small)"
        shards = math.prod(dist.mesh_shape[a] for a in axes if a)
        nbytes = math.prod(shape) * np.dtype(v.dtype).itemsize
        rows.append({"path": v.path, "shape": shape, "axes": axes, "rule": rule,
                     "bytes_per_device": nbytes / shards})
    width = max((len(r["path"]) for r in rows), default=10)
    lines = [f"{'weight':<{width}}  {'shape':<20}{'layout':<26}{'per device':>12}  rule"]
    for r in rows:
        layout = "(" + ", ".join(a or "-" for a in r["axes"]) + ")"
        lines.append(f"{r['path']:<{width}}  {str(r['shape']):<20}{layout:<26}"
                     f"{r['bytes_per_device']:>12,.0f}  {r['rule']}")
    total = sum(r["bytes_per_device"] for r in rows)
    lines.append(f"{len(rows)} weights, {total:,.0f} bytes per device")
    return rows, "\n".join(lines)
