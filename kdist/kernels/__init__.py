"""Attention kernels kdist runs where they are faster than XLA, each with a float32 parity
test against the reference attention (Pallas kernels in interpret mode on a CPU).

============  =================================================================================
``splash``    Pallas splash attention for TPUs (``jax.experimental.pallas.ops.tpu``) in
              kdist's ``(B, T, N, H)`` layout
``flash``     kdist's own Pallas flash attention for TPUs: causal tiles skipped by loop
              bounds, bfloat16 matmuls, one backward kernel; where splash falls short
``sharding``  either kernel per device under a kdist distribution (replica rows, model heads)
============  =================================================================================

Which one a model runs is :mod:`kdist.accelerators`' choice.
"""

from kdist.kernels.flash import FlashBlocks, flash_attention
from kdist.kernels.sharding import per_device
from kdist.kernels.splash import Blocks, splash_attention

__all__ = ["Blocks", "FlashBlocks", "flash_attention", "per_device", "splash_attention"]
