"""Per-device memory of a step run by the pipeline interpreter (``pipeline_schedule``
``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"``: :mod:`kdist.parallel.pipeline.interpreter`),
beside the weights and their optimizer state (:func:`kdist.planning.stages.memory`).

The program is one ``lax.scan`` over the table's ticks whose body switches on the task.
XLA gives the switch the space of its costliest branch on every device (the program is
the same everywhere), so the peak is what lives through the whole schedule plus what the
last virtual stage's backward (``B``, or ``I``) needs while it runs — its forward with the
loss, then the vjp of both, for one microbatch:

* **the chunk's residuals**: ``jax.vjp`` of the chunk's blocks, a ``lax.scan`` over them:
  every residual JAX saves is a loop output XLA must store, none recomputed inside a
  fusion as it can without the loop. Measured in the compiled gpt2-small step
  (``stage=4,seq=2``, the buffers live at the peak): per block and token 11 values of
  width ``D`` and 6 of the MLP's width (GELU's tanh approximation keeps its
  intermediates), against the cost model's 9 and 2 (:meth:`activation_bytes_per_token`
  with ``remat=False``, what a program without the loop keeps): :data:`SCAN_EXTRA` adds
  the difference per block; with ``seq`` and ``context_parallel="all_gather"``, every
  block's gathered keys and values too;
* **a MoE model's experts** under an ``expert`` axis: one microbatch's dispatch buffers
  and expert rows through the chunk's MoE layers
  (:func:`kdist.planning.experts.activation_bytes`), and per MoE layer of the chunk
  what the scan's vjp keeps beside them: the layer's expert weights in their **whole
  shape** — each device's experts padded with zeros (:func:`kdist.parallel.experts.
  as_whole`, in the scan's body) are a residual of the loop, ``4 P_e / L`` bytes, not the
  device's ``1/e`` — and one more ``F``-wide value per row (the SwiGLU's sigmoid, as
  :data:`SCAN_EXTRA` for a dense MLP). Measured on the compiled 1F1B gpt-nano-moe step
  (``expert=2,stage=2,data=2``, batch 16 x 64): 2, 4 layers per stage and 2 or 4
  microbatches: 0.955-0.985 of the peak (0.77-0.79 without these two terms);
* **the head**: the cost model's logits and their gradient, and a third logits-sized
  buffer (the log-softmax, which XLA:CPU keeps beside them: three 1.5 GiB buffers at
  gpt2-small's peak);
* **through the schedule**: the embedding's output for the whole batch, its gradient
  (accumulated per microbatch) and the schedule's inputs ``xm``; the input and cotangent
  buffer slots (:class:`kdist.parallel.pipeline.interpreter.Program`); the head's weights whole
  (they enter the region replicated, ``P()``) and their gradient, and the stage's blocks'
  gradient accumulated over the ticks.

Example:
    >>> from kdist.planning.estimate import cost_model_of
    >>> from kdist.planning.stages import split
    >>> cost = cost_model_of("gpt-nano")
    >>> m = memory(cost, split(cost, 256, 4, False), {"stage": 4}, 16, 256, 4, "1f1b", 8)
    >>> sorted(m)
    ['activations', 'pipeline']
"""

from __future__ import annotations

from typing import Any

from kdist.parallel.pipeline import interpreter, schedules
from kdist.planning import experts

# Per block and token, the values a scan's vjp keeps beyond the cost model's ``False``
# set (see the module docstring): 2 more of width D, 4 more of the MLP's width.
SCAN_EXTRA = {"hidden_dim": 2, "intermediate_dim": 4}
HEAD_COPIES = 1  # logits-sized buffers beyond the cost model's two (the log-softmax)


def memory(cost: Any, parts: dict[str, float], mesh: dict[str, int], rows: float,
           sequence_length: int, value_bytes: int, schedule: str, microbatches: int,
           repeats: int = 1, dims: dict | None = None, context_parallel: str = "all_gather",
           remat: bool = False) -> dict[str, float]:
    """``{"activations", "pipeline"}`` bytes per device of the interpreter's step for
    ``rows`` sequences per device (one replica group's batch over ``data x fsdp``, per
    micro-step); ``parts``: the model's parameters and activations split into blocks and
    the rest (:func:`kdist.planning.stages.split`, at the length each device holds); the
    weights, optimizer state and gradients are the caller's."""
    from kdist.planning.traffic import gathered_kv_bytes

    s, m, seq = mesh.get("stage", 1), mesh.get("model", 1), mesh.get("seq", 1)
    dims = dims or {}
    hidden = dims.get("hidden_dim") or 0
    config = getattr(cost, "config", {}) or {}
    tokens = rows * sequence_length / seq  # per device, the whole micro-step
    per_micro = tokens / microbatches
    layers = (dims.get("num_layers") or 0) / (s * repeats)  # one chunk's blocks
    extra = 0.0 if remat else value_bytes * layers * sum(
        n * (config.get(k) or 0) for k, n in SCAN_EXTRA.items())
    residuals = (parts["block_activations"] / (s * repeats) + extra) * per_micro / m
    # A MoE model's: one microbatch's dispatch buffers and expert rows through the chunk's
    # MoE layers (kdist.planning.experts; its experts whole in shape one layer at a time).
    found = getattr(cost, "experts", None)
    e = mesh.get("expert", 1)
    if found:
        chunk = found.layers / (s * repeats)
        residuals += experts.activation_bytes(cost, per_micro, value_bytes, remat, e, m,
                                              layers=chunk)
        if e > 1:  # what the scan's vjp keeps beside them: see the module docstring
            residuals += chunk * (4 * found.parameters / found.layers + value_bytes * experts.rows(
                found, per_micro, e) * found.expert_dim / m)
    if seq > 1 and context_parallel == "all_gather":
        residuals += gathered_kv_bytes(dims, rows / microbatches, sequence_length, m,
                                       value_bytes, 1 if remat else layers)
    vocabulary = config.get("vocabulary_size") or 0
    head = (parts["other_activations"] + HEAD_COPIES * vocabulary * 4) * per_micro / m
    program = interpreter.Program(schedules.build(schedule, s, microbatches, repeats))
    slots = program.input_slots + program.cotangent_slots
    through = (3 * tokens + slots * per_micro) * hidden * value_bytes / m
    head_weights = 2 * 4 * (parts["table_parameters"] + parts["other_parameters"]) / m
    # The carry's accumulator of the stage's blocks' gradient (under fsdp, with the
    # weights gathered whole: the caller's ``gathered``).
    block_gradient = (4 * experts.stage_block_values(parts, e) / (s * m)
                      if mesh.get("fsdp", 1) == 1 else 0.0)
    return {"activations": residuals + head + through,
            "pipeline": head_weights + block_gradient}
