"""Memory sizes: reading and printing bytes, a device's memory, the usable share of it.

Example:
    >>> from kdist.planning.units import format_bytes, parse_bytes
    >>> format_bytes(parse_bytes("1.5GiB"))
    '1.50 GiB'
"""

from __future__ import annotations

import os
import re

# Fraction of device memory a plan may use: allocators and runtimes keep some back
# (XLA:GPU preallocates 75% by default; we budget 90% of the stated memory).
USABLE_FRACTION = 0.9
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"``, ``"24 GB"``, ``"512MiB"`` or a number of bytes, as an int.

    Example:
        >>> parse_bytes("80GiB"), parse_bytes("1.5 GB"), parse_bytes(1024)
        (85899345920, 1500000000, 1024)
    """
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"Cannot read a memory size from {text!r}. Write e.g. '80GiB', "
                         f"'24GB', '512MiB' or a number of bytes.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Bytes in binary units, e.g. ``'1.50 GiB'``.

    Example:
        >>> format_bytes(3 * 2**29)
        '1.50 GiB'
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def default_device_memory(device=None) -> int:
    """Memory of one device: the backend's ``bytes_limit`` where it reports one (GPU, TPU);
    on CPU, the host's physical memory divided among the host devices.

    Example:
        >>> default_device_memory() > 0
        True
    """
    import jax

    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(1, jax.local_device_count())


def device_memory_source(device=None) -> str:
    """Where :func:`default_device_memory`'s figure comes from, in words (a plan's first
    line says it, so a plan for a CPU host's share is never mistaken for an accelerator's).

    Example:
        >>> "device" in device_memory_source()
        True
    """
    import jax

    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return f"the {device.platform} device's own limit"
    return (f"this host's physical memory shared by its {jax.local_device_count()} "
            f"{device.platform} devices, as no device memory was given: pass "
            f"--device-memory (e.g. 80GiB) to plan for an accelerator")
