"""Ticks that every stage runs alike: how ring attention runs inside a pipeline schedule.

The interpreter (:mod:`kdist.parallel.pipeline.interpreter`) normally runs each stage's task of a
tick in its own branch of a ``lax.switch``: a stage that idles computes nothing. A
collective inside a stage's layers then runs on the devices of the stages that took that
branch only. All-gather attention's collectives involve one ``seq`` group at a time, whose
devices always share a stage, so that works; ring attention's collective-permutes do not
(XLA:CPU's permutes rendezvous with every device of the program: the process aborts).

The lockstep tables (:data:`kdist.parallel.pipeline.schedules.LOCKSTEP`) run forwards only or
backwards only in each tick, so every stage can run the same code in every tick, as
GPipe's scan does: a forward tick runs every stage's layers (an idle stage's on zeros,
its output dropped), a backward tick every stage's ``jax.vjp`` of its layers, the last
virtual stage adding the loss's gradient at its output (a ``lax.cond`` holding no
collective over ``seq``). The kind of a tick is the same on every device, so the one
branch (forward or backward) every device takes holds the same collectives everywhere.
In lockstep an idle stage waits for the tick's slowest task anyway, so computing on zeros
lengthens no tick; the loss's gradient stays on the last stage. Zero-bubble's ticks mix
kinds: they cannot run this way.

Example:
    >>> from kdist.parallel.pipeline import interpreter, schedules
    >>> forward_ticks(interpreter.Program(schedules.build("1f1b", 2, 2))).tolist()
    [True, False, True, False, False]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FORWARD, BACKWARD, LAST_BACKWARD = 1, 2, 3  # kdist.parallel.pipeline.interpreter's action codes


def forward_ticks(program) -> np.ndarray:
    """Per tick of ``program`` (an :class:`kdist.parallel.pipeline.interpreter.Program`), True for
    a tick of forwards, False for one of backwards. Raises ``ValueError`` naming the
    schedule if a tick mixes kinds or splits a backward (zero-bubble)."""
    action = program.action
    forward = (action == FORWARD).any(axis=1)
    allowed = np.where(forward[:, None], np.isin(action, (0, FORWARD)),
                       np.isin(action, (0, BACKWARD, LAST_BACKWARD)))
    if not allowed.all():
        raise ValueError(
            f"pipeline_schedule={program.table.name!r} runs ticks that mix forwards and "
            f"backwards (or split a backward in two), so its stages cannot all run the same "
            f"collectives in every tick, as ring attention needs. Use pipeline_schedule="
            f"'1f1b' or 'interleaved_1f1b', or context_parallel='all_gather'.")
    return forward


def run_task(is_forward, action, w, x, g, layers, loss, loss_weights, vary, one, no_stats):
    """One device's task of a tick every stage runs alike.

    ``is_forward``: the tick's kind (the same on every device); ``action``: this stage's
    action code (idle, forward, backward, last backward); ``layers(w, x)`` the stage's
    layers on a microbatch, ``(y, their loss, their statistics)``
    (:func:`kdist.parallel.pipeline.interpreter.interpret`); ``loss(loss_weights, y)`` its
    share of the loss from the last virtual stage's output; ``vary`` types a pytree varying
    over the region's manual axes; ``one`` the layers' loss's cotangent; ``no_stats``
    zeros shaped like the statistics. Returns ``(y, dx, dw, d_loss_weights, loss_value,
    statistics)`` as the interpreter's branches do: zeros for an idle stage.
    """
    active = action != 0
    last = action == LAST_BACKWARD
    x = jnp.where(active, x, jnp.zeros_like(x))  # never a leftover value: its NaN would
    g = jnp.where(active, g, jnp.zeros_like(g))  # pass the discarding where's gradient

    def zero(tree):
        return vary(jax.tree.map(jnp.zeros_like, tree))

    def forward(w, x, g):
        y = layers(w, x)[0]
        return vary((jnp.where(active, y, jnp.zeros_like(y)), jnp.zeros_like(x), zero(w),
                     zero(loss_weights), jnp.zeros((), jnp.float32), no_stats))

    def head(y):  # the last virtual stage: the loss and its gradient at the stack's output
        def value(lw, y):
            return loss(lw, y).astype(jnp.float32)

        out, (d_lw, dy) = jax.value_and_grad(value, argnums=(0, 1))(vary(loss_weights), y)
        return vary((out, d_lw, dy))

    def no_head(y):
        return vary((jnp.zeros((), jnp.float32), zero(loss_weights), jnp.zeros_like(y)))

    def backward(w, x, g):
        def stage(w, x):  # ((y, the layers' loss), statistics): vjp's has_aux form
            y, extra, stats = layers(w, x)
            return (y, extra), stats

        (y, extra), vjp, stats = jax.vjp(stage, w, x, has_aux=True)
        value, d_lw, dy = jax.lax.cond(last, head, no_head, y)
        # an idle stage's layers ran on zeros: their loss and statistics are not counted
        dw, dx = vjp((jnp.where(last, dy, g).astype(y.dtype), jnp.where(active, one, 0.0)))
        stats = jax.tree.map(lambda a: jnp.where(active, a, jnp.zeros_like(a)), stats)
        return vary((jnp.zeros_like(x), dx, dw, d_lw, value + jnp.where(active, extra, 0.0),
                     stats))

    return jax.lax.cond(is_forward, forward, backward, vary(w), vary(x), vary(g))
