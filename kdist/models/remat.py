"""Rematerialisation policies of a Transformer block: what its forward pass keeps for the
backward pass, and what the backward pass recomputes.

==============  ===========================================================================
``False``       keep everything the backward pass needs (XLA frees and fuses what it can)
``"minimal"``   keep what the backward pass's matmuls need and element-wise work cannot
                give back cheaply: attention's inputs, output and softmax statistics, the
                residual stream between attention and MLP, the MLP's hidden pre-activation;
                recompute element-wise work only (norms, activations, casts)
``"save_dots"`` keep the projections' and MLP's matmul outputs; recompute element-wise work
                and attention itself
``"block"``     keep only the block's input (``True`` is the same): the whole forward pass
                runs again in the backward pass (+1/3 of the block's FLOPs)
``"auto"``      the device's choice for the step's shapes (:mod:`kdist.accelerators`): the
                least recompute whose compiled step fits the device's memory
==============  ===========================================================================

A scanned layer stack (``scan_layers=True``) has no "keep everything": JAX decides what a
``lax.scan`` keeps before XLA sees it, and without a policy it keeps every intermediate of
every layer — float32 activation temporaries included (gpt2-small at batch 16 x 1024 on a
TPU v5e: 15.1 GiB of temporaries against 4.5 GiB unrolled, measured by compiling for the
chip). A stack's blocks therefore run ``"minimal"`` where the block says ``False``:
what XLA keeps of an unrolled block.

Example:
    >>> rematerialised(lambda x: x * 2, "minimal")(keras.ops.ones(2)).shape
    (2,)
"""

from __future__ import annotations

import contextlib
import threading

import keras

from kdist.kernels.splash import RESIDUALS

REMAT_POLICIES = (False, True, "block", "save_dots", "minimal", "auto")
# Checkpoint names of what "minimal" keeps: attention's output and softmax statistics
# (splash, kdist's flash and chunked attention name theirs so), attention's inputs (q,
# k, v after RoPE), the residual stream between a block's attention and its MLP, the MLP's
# hidden pre-activations (up, gate).
ATTENTION = RESIDUALS
ATTENTION_INPUTS = "attention_inputs"
MIDPOINT = "block_midpoint"
MLP_HIDDEN = "mlp_hidden"

_traced = threading.local()  # what "auto" means and whether a stack is scanning, per trace


def check(remat) -> bool | str:
    """``remat`` if it is one of :data:`REMAT_POLICIES`, else a ``ValueError``."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"Unknown remat {remat!r}. Use one of {REMAT_POLICIES} (True means "
                         f"'block'; 'auto': chosen by the device).")
    return remat


def checkpoint_policy(remat):
    """The ``jax.checkpoint`` policy of a policy name (None for ``"block"``: save nothing)."""
    import jax

    cp = jax.checkpoint_policies
    if remat == "save_dots":
        return cp.dots_with_no_batch_dims_saveable
    if remat == "minimal":
        return cp.save_only_these_names(ATTENTION, ATTENTION_INPUTS, MIDPOINT, MLP_HIDDEN)
    return None


def rematerialised(fn, remat):
    """``fn`` wrapped for rematerialisation under a resolved policy (not ``"auto"``);
    ``fn`` itself for ``False``.

    Example:
        >>> rematerialised(lambda x: x * 2, "save_dots")(keras.ops.ones(2)).shape
        (2,)
    """
    if remat is False or remat is None:
        return fn
    if remat in (True, "block"):
        return keras.remat(fn)
    import jax

    return jax.checkpoint(fn, policy=checkpoint_policy(remat))


def named(x, name: str):
    """``x`` (a pytree) named for the policies above (an identity outside ``jax.checkpoint``)."""
    from jax.ad_checkpoint import checkpoint_name

    return checkpoint_name(x, name)


def in_scan(remat):
    """The policy a scanned stack's block runs for the block's resolved ``remat``."""
    return "minimal" if remat is False or remat is None else remat


def effective(remat):
    """The policy a block runs now for its ``remat``: ``"auto"`` as the training step being
    traced resolved it (:func:`choosing`; ``False`` outside one: evaluation and prediction
    keep nothing for a backward pass), and in a scanned stack :func:`in_scan`'s."""
    if remat == "auto":
        remat = getattr(_traced, "auto", False)
    return in_scan(remat) if getattr(_traced, "stacked", False) else remat


@contextlib.contextmanager
def choosing(policy):
    """Trace with ``"auto"`` meaning ``policy`` (a training step, whose shapes decide it)."""
    previous = getattr(_traced, "auto", False)
    _traced.auto = check(policy)
    try:
        yield
    finally:
        _traced.auto = previous


@contextlib.contextmanager
def stacked():
    """Trace the body of a scanned layer stack (its blocks run :func:`in_scan`'s policy)."""
    previous = getattr(_traced, "stacked", False)
    _traced.stacked = True
    try:
        yield
    finally:
        _traced.stacked = previous
