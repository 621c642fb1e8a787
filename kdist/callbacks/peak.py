"""The dense peak TFLOP/s of a device, the denominator of MFU: a data-sheet table, a
user's figure, or a matmul measured on this machine.

A measured peak (CPU, or a device the table does not know) is the **best of several** timed
matmuls with every device busy at once, and it is **kept per machine** in
``$KDIST_CACHE/peak.json`` (default ``~/.cache/kdist``), keyed by platform, device kind,
device count and dtype, so later runs reuse the best figure ever measured instead of one
taken under whatever load there is at start-up. A measurement is marked **unreliable** when
its runs disagree (the slowest-half median over 1.5x the best) or, on CPU, when the load
average exceeded the cores while it ran; an unreliable figure is measured again at the next
start and the cache keeps the higher one. ``Throughput`` says so in its rows, and never
reports an MFU above 1 (see ``kdist.callbacks.throughput``).

Example:
    >>> device_peak(override_tflops=100.0).describe()  # doctest: +ELLIPSIS
    '100 TFLOP/s bfloat16 per device (override: ...)'
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
from pathlib import Path

from kdist import accelerators

CACHE_FILE = "peak.json"
REPEATS = 5  # timed matmuls per measurement
NOISY_SPREAD = 1.5  # median of the runs over the best one above this: a busy machine


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's dense peak TFLOP/s and where the figure comes from.

    ``source`` is ``"table"`` (a data-sheet figure from :mod:`kdist.accelerators`, whose
    page ``note`` names), ``"measured"`` (a matmul benchmark on this machine: CPU or an
    unknown device) or ``"override"`` (given by the user, e.g. ``--peak-tflops``).
    ``unreliable`` says why a measured figure may be too low (None when there is no such
    sign); ``note`` how it was obtained.

    Example:
        >>> Peak(989.0, "table", "NVIDIA H100 80GB HBM3", "bfloat16").tflops
        989.0
    """

    tflops: float
    source: str
    device_kind: str
    dtype: str
    unreliable: str | None = None
    note: str = ""

    def row(self) -> dict:
        """The figure's fields in the run log's config row."""
        return {"device_kind": self.device_kind, "peak_tflops_per_device": self.tflops,
                "peak_source": self.source, "peak_unreliable": self.unreliable,
                "peak": self.describe()}

    def describe(self) -> str:
        """E.g. ``"989 TFLOP/s bfloat16 per device (table: NVIDIA H100 80GB HBM3)"``, or
        ``"... (measured (unreliable: ...): cpu)"``."""
        source = self.source + (f", {self.note}" if self.note else "")
        if self.unreliable:
            source += f" (unreliable: {self.unreliable})"
        return f"{self.tflops:.4g} TFLOP/s {self.dtype} per device ({source}: {self.device_kind})"


def matmul_peak(peak: Peak, flops, model=None, matmul_precision: str | None = None,
                head_matmul_precision: str | None = None) -> Peak:
    """``peak`` for a step of ``flops`` training FLOPs per token (a
    ``kdist.flops.FlopsPerToken``) under ``matmul_precision`` (default: ``model``'s
    backbone's, ``"bf16"`` for a model without one) and ``head_matmul_precision`` (default:
    ``model``'s, e.g. ``GPTCausalLM``'s; ``"bf16"`` without one). Both ``"bf16"``:
    ``peak`` itself. Quantized, with a table peak: the blend of the chip's int8 and
    ``peak.dtype`` rates by the quantized share of the FLOPs
    (:func:`kdist.precision.peak.peak_tflops`, what ``kdist plan`` divides by). A
    measured or given peak, or a chip with no published figure for the precision: ``peak``
    unchanged, its note saying the quantized matmuls are counted at it.

    Example:
        >>> from kdist.flops import transformer_flops_per_token
        >>> f = transformer_flops_per_token(4, 256, 4, 1024, 8192, 256)
        >>> v5e = Peak(197.0, "table", "TPU v5 lite", "bfloat16")
        >>> round(matmul_peak(v5e, f, matmul_precision="int8").tflops, 1)
        275.5
    """
    from kdist.precision import peak as blended

    if matmul_precision is None:
        backbone = getattr(model, "backbone", model)
        matmul_precision = getattr(backbone, "matmul_precision", None) or "bf16"
    if head_matmul_precision is None:
        head_matmul_precision = getattr(model, "head_matmul_precision", None) or "bf16"
    if (matmul_precision == "bf16" and head_matmul_precision == "bf16") or flops is None:
        return peak
    named = matmul_precision + (f" (head {head_matmul_precision})"
                                if head_matmul_precision != "bf16" else "")
    entry = accelerators.for_device_kind(peak.device_kind) if peak.source == "table" else None
    try:
        if entry is None:
            raise ValueError(f"a {peak.source} peak")
        tflops = blended.peak_tflops(entry, matmul_precision, flops, peak.dtype,
                                     head_matmul_precision)
    except ValueError as e:
        why = str(e).split(" (")[0] if entry is not None else f"a {peak.source} peak"
        note = (f"{peak.note}; " if peak.note else "") + (
            f"{named} matmuls counted at this {peak.dtype} peak ({why})")
        return dataclasses.replace(peak, note=note)
    return dataclasses.replace(peak, tflops=tflops, note=blended.peak_line(
        entry, matmul_precision, flops, head_matmul_precision))


def table_peak_tflops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """The data-sheet dense peak for a JAX ``device_kind`` (:mod:`kdist.accelerators`), or
    None if it is not in the table.

    Example:
        >>> table_peak_tflops("NVIDIA H100 80GB HBM3"), table_peak_tflops("TPU v5 lite")
        (989.0, 197.0)
        >>> table_peak_tflops("cpu") is None
        True
    """
    entry = accelerators.for_device_kind(device_kind)
    return None if entry is None else entry.tflops(dtype)


def device_peak(
    devices: list | None = None,
    dtype: str = "bfloat16",
    override_tflops: float | None = None,
    *,
    cache: bool = True,
) -> Peak:
    """The peak TFLOP/s of one of ``devices`` (default: all local devices) for ``dtype``.

    Order: ``override_tflops`` if given, else the table, else the machine's measured peak
    (:func:`measure_peak`; with ``cache``, the best figure kept in ``$KDIST_CACHE``).

    Example:
        >>> device_peak(override_tflops=100.0).source
        'override'
    """
    import jax

    devices = list(devices) if devices is not None else jax.local_devices()
    kind = devices[0].device_kind
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(f"The peak override must be positive TFLOP/s; got "
                             f"{override_tflops}. E.g. --peak-tflops 989 for an H100 in bf16.")
        return Peak(float(override_tflops), "override", kind, dtype)
    entry = None if devices[0].platform == "cpu" else accelerators.for_device_kind(kind)
    if entry is not None:
        return Peak(entry.tflops(dtype), "table", kind, dtype,
                    note=f"{entry.name} in {entry.source}")
    if not cache:
        return measure_peak(devices, dtype)
    return _cached_peak(devices, dtype)


def measure_peak(devices: list, dtype: str = "float32", repeats: int = REPEATS) -> Peak:
    """Measures the matmul peak now (best of ``repeats``), judging the measurement.

    Example:
        >>> import jax
        >>> measure_peak(jax.devices()[:1]).tflops > 0
        True
    """
    load_before = _load()
    times, flops = _time_matmul(tuple(devices), dtype, repeats)
    load = max(load_before, _load())
    best = min(times)
    spread = statistics.median(times) / best
    reasons = []
    if spread > NOISY_SPREAD:
        reasons.append(f"runs varied {spread:.1f}x")
    cores = os.cpu_count() or 1
    if devices[0].platform == "cpu" and load > cores:
        reasons.append(f"load {load:.1f} on {cores} cores")
    return Peak(flops / best / 1e12, "measured", devices[0].device_kind, dtype,
                "; ".join(reasons) or None, f"best of {len(times)}")


@functools.cache
def measured_peak_tflops(devices: tuple, dtype: str = "float32", repeats: int = 5) -> float:
    """Best-of-``repeats`` matmul TFLOP/s per device, with all ``devices`` busy at once.

    All devices run at once because host (CPU) devices share the same cores: measured one
    at a time, each would see the whole machine. Cached per (devices, dtype) in the process.

    Example:
        >>> import jax
        >>> measured_peak_tflops(tuple(jax.devices()[:1]), "float32") > 0
        True
    """
    times, flops = _time_matmul(devices, dtype, repeats)
    return flops / min(times) / 1e12


def _time_matmul(devices: tuple, dtype: str, repeats: int) -> tuple[list[float], float]:
    """Seconds of each of ``repeats`` runs of one (M, M) @ (M, M) matmul per device, all
    devices at once; and the FLOPs each device does per run."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    size = 1024 if devices[0].platform == "cpu" else 4096
    mesh = Mesh(np.asarray(devices), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    x = jax.device_put(jnp.ones((len(devices), size, size), dtype), sharding)
    # (n, M, M) @ (n, M, M): each device multiplies its own pair.
    matmul = jax.jit(lambda a: jnp.einsum("nij,njk->nik", a, a), out_shardings=sharding)
    matmul(x).block_until_ready()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return times, 2.0 * size**3


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def cache_path() -> Path:
    """``$KDIST_CACHE/peak.json`` (default ``~/.cache/kdist/peak.json``)."""
    root = os.environ.get("KDIST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kdist")
    return Path(root) / CACHE_FILE


def _cached_peak(devices: list, dtype: str) -> Peak:
    """The machine's best measured peak: the cached figure when a quiet measurement backs
    it, else a new measurement merged with the cached one (the higher figure; reliable if
    either measurement was), stored for the next run."""
    kind = devices[0].device_kind
    key = f"{devices[0].platform}/{kind}/{len(devices)}/{dtype}"
    path = cache_path()
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        entries = {}
    entry = entries.get(key) if isinstance(entries, dict) else None
    if not (isinstance(entry, dict) and float(entry.get("tflops", 0)) > 0):
        entry = None
    if entry is not None and not entry.get("unreliable"):
        return Peak(float(entry["tflops"]), "measured", kind, dtype, None,
                    f"best of {entry.get('runs', '?')} runs, kept in {path}")
    peak = measure_peak(devices, dtype, REPEATS)
    runs = REPEATS
    if entry is not None:
        runs += int(entry.get("runs", 0))
        peak = dataclasses.replace(
            peak, tflops=max(peak.tflops, float(entry["tflops"])),
            unreliable=peak.unreliable and entry.get("unreliable"))
    peak = dataclasses.replace(peak, note=f"best of {runs} runs")
    entries = entries if isinstance(entries, dict) else {}
    entries[key] = {"tflops": peak.tflops, "unreliable": peak.unreliable, "runs": runs,
                    "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
        os.replace(tmp, path)  # atomic: a concurrent run never reads half a file
    except OSError:
        pass  # a read-only cache: the figure still serves this run
    return peak
