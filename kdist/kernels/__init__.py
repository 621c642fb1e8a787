"""Attention kernels kdist runs where they are faster than XLA, each with a float32 parity
test against the reference attention (Pallas kernels in interpret mode on a CPU).

==========  ===================================================================================
``splash``  Pallas splash attention for TPUs (``jax.experimental.pallas.ops.tpu``) in kdist's
            ``(B, T, N, H)`` layout, per device under a kdist distribution
==========  ===================================================================================

Which one a model runs is :mod:`kdist.accelerators`' choice.
"""

from kdist.kernels.splash import Blocks, splash_attention

__all__ = ["Blocks", "splash_attention"]
