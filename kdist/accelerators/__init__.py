"""Accelerators: what each chip offers, and what kdist decides by it.

=============  ================================================================================
``table``      the published figures per chip (peak, HBM, ICI/NVLink, DCN/InfiniBand, chips
               per host and slice), read by MFU and the planner
``defaults``   the device a trace is for (:func:`target`, :func:`assume`), and the defaults
               chosen by it: attention implementation and its tiles, ``remat="auto"``,
               a recipe's batch
=============  ================================================================================

Example:
    >>> accelerator("tpu-v5e").bf16_tflops
    197.0
"""

from kdist.accelerators.defaults import (
    ATTENTION_IMPLEMENTATIONS,
    DEFAULT_CHUNK,
    Target,
    assume,
    attention_for,
    check_implementation,
    default_batch,
    device_memory,
    flash_blocks,
    remat_for,
    remat_for_data,
    splash_blocks,
    step_bytes,
    target,
)
from kdist.accelerators.table import (
    NAMES,
    Accelerator,
    accelerator,
    for_device_kind,
)

__all__ = [
    "ATTENTION_IMPLEMENTATIONS", "Accelerator", "DEFAULT_CHUNK", "NAMES", "Target", "accelerator",
    "assume", "attention_for", "check_implementation", "default_batch", "device_memory",
    "flash_blocks", "for_device_kind", "remat_for", "remat_for_data", "splash_blocks",
    "step_bytes", "target",
]
