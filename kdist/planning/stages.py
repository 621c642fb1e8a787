"""Planning a pipeline (a ``stage`` mesh axis): per-device memory, bytes between stages,
the bubble and what each stage computes — analytic, from the model's cost model.

The arithmetic follows :mod:`kdist.parallel.pipeline`: stage ``s`` of S holds ``L / S``
blocks (with R circular repeats, ``L / (R S)`` of each repeat); the embedding, the head
and the loss run outside the pipeline, on every stage, over the stage group's rows.
With ``d``, ``f``, ``m`` the data, fsdp and model axes, ``n`` a device's tokens per
micro-step (``B / g / (d f) x T``) and ``D`` the width:

* the vocabulary: without a ``model`` axis the token table and the head are split over the
  stages (``kdist.parallel.rules.FALLBACK_MESH``): each stage computes ``1 / S`` of the
  logits, at the price of two activation all-reduces over stages (the embedding's output,
  the head's input gradient);
* memory: block weights (and their optimizer state and gradients) ``/ (S f m)``; the token
  table ``/ (S f)`` (``/ (f m)`` with a model axis); the other weights ``/ (f m)``; with
  ``f > 1`` the stage's block weights and their gradient whole over fsdp during the step
  (gathered once); the blocks' activations ``/ S``, times ``(R M + S - 1) / (R M)`` (bubble
  iterations keep theirs too); the head's ``/ S`` (or ``/ m``); the schedule's buffers
  (inputs, outputs, circular store) ``~ n D x 4`` each;
* experts (a MoE model with an ``expert`` axis ``e``, which splits the rows as data
  does): the routed experts' weights, Adam's state and gradient ``/ (S e f m)``
  (:func:`kdist.planning.experts.stage_block_values`); the dispatch and combine
  all-to-alls of one microbatch's buffer at every pass of a MoE layer; the 1F1B
  schedules' experts' activations: :mod:`kdist.planning.schedule_memory` (GPipe's are
  not checked, and ``auto`` does not propose GPipe with ``expert``);
* bytes: one microbatch activation ``n / M x D`` per iteration to the next stage, forward
  and backward (``collective-permute``); the outputs' and the inputs' cotangent summed over
  stages once (``all-reduce``); the stage's weights gathered over fsdp once and their
  gradient reduced once.

Example:
    >>> from kdist.models import GPTCausalLM, GPT_PRESETS
    >>> cost = GPTCausalLM.cost_model_for(GPT_PRESETS["gpt2-xl"])
    >>> s = summary(cost, {"stage": 8}, 8, 1024, microbatches=8)
    >>> round(s["bubble"], 3), s["blocks_per_stage"]
    (0.467, 6)
"""

from __future__ import annotations

import copy
from typing import Any

from kdist.parallel.pipeline import interpreter, schedules
from kdist.parallel.pipeline.settings import bubble_fraction
from kdist.planning import experts

TIMELINE_TICKS = 48  # the longest schedule `kdist plan` draws


def _ring(n: int) -> float:
    return (n - 1) / n


def _sizes(mesh: dict[str, int]) -> tuple[int, int, int, int]:
    return (mesh.get("data", 1), mesh.get("stage", 1), mesh.get("fsdp", 1),
            mesh.get("model", 1))


def without_blocks(cost: Any) -> Any | None:
    """The cost model with no blocks (``num_layers=0``: embeddings, head, final norm), or
    None for a cost model without a ``config`` naming ``num_layers``."""
    config = getattr(cost, "config", None)
    if not isinstance(config, dict) or "num_layers" not in config:
        return None
    other = copy.copy(cost)
    other.config = {**config, "num_layers": 0}
    return other


def vocab_stages(mesh: dict[str, int]) -> int:
    """Over how many stages the vocabulary (token table, head) is split: S without a
    ``model`` axis, else 1 (it is split over ``model``)."""
    return mesh.get("stage", 1) if mesh.get("model", 1) == 1 else 1


def split(cost: Any, sequence_length: int, value_bytes: int, remat: bool) -> dict[str, float]:
    """Parameters and activation bytes per token of the blocks, of the token table(s) and
    of the rest (the head's activations are counted with the table)."""
    rest = without_blocks(cost)
    if rest is None:  # no per-layer figures: treat everything as blocks
        return {"block_parameters": float(cost.parameters), "routed_parameters": 0.0,
                "table_parameters": 0.0,
                "other_parameters": 0.0, "block_activations": cost.activation_bytes_per_token(
                    sequence_length, value_bytes, remat), "other_activations": 0.0}
    total = cost.activation_bytes_per_token(sequence_length, value_bytes, remat)
    other = rest.activation_bytes_per_token(sequence_length, value_bytes, remat)
    c = cost.config
    rows = c.get("vocabulary_size", 0)
    multiple = c.get("vocabulary_divisible_by") or 1
    rows = -(-rows // multiple) * multiple
    table = rows * c.get("hidden_dim", 0) * (1 if c.get("tie_embeddings", True) else 2)
    table = min(table, rest.parameters)
    return {"block_parameters": float(cost.parameters - rest.parameters),
            "routed_parameters": float(experts.routed_parameters(cost)),
            "table_parameters": float(table),
            "other_parameters": float(rest.parameters - table),
            "block_activations": total - other, "other_activations": other}


def _moe_layers(cost: Any) -> int:
    found = getattr(cost, "experts", None)
    return found.layers if found else 0


def memory(cost: Any, mesh: dict[str, int], global_batch_size: int, sequence_length: int,
           value_bytes: int, remat: bool = False, grad_accum: int = 1,
           microbatches: int | None = None, repeats: int = 1, dims: dict | None = None,
           context_parallel: str = "all_gather", schedule: str = "gpipe") -> dict[str, float]:
    """Per-device bytes of a pipelined step (see the module docstring); with a ``seq``
    axis each stage keeps ``1/s`` of every sequence's tokens (no ``T x T`` scores) and,
    with ``context_parallel="all_gather"``, its blocks' gathered keys and values.
    ``global_batch_size``: one replica group's."""
    from kdist.planning.traffic import gathered_kv_bytes

    d, s, f, m = _sizes(mesh)
    seq, e = mesh.get("seq", 1), mesh.get("expert", 1)
    dims = dims or {}
    micro = microbatches or s
    parts = split(cost, sequence_length if seq == 1 else 1, value_bytes, remat)
    v = vocab_stages(mesh)
    blocks = experts.stage_block_values(parts, e)  # a stage's, whole over fsdp and model
    weights = 4 * (blocks / (s * f * m) + parts["table_parameters"]
                   / (v * f * m) + parts["other_parameters"] / (f * m))
    rows = global_batch_size / grad_accum / (d * f * e)  # expert splits the rows as data
    tokens = rows * sequence_length / seq
    stretch = (repeats * micro + s - 1) / (repeats * micro)
    gathered = 2 * 4 * blocks / (s * m) if f > 1 else 0.0
    if schedule == "gpipe":  # every iteration's activations, kept for the backward scan
        activations = (parts["block_activations"] / s * stretch
                       + parts["other_activations"] / v) * tokens / m
        # (a MoE model's dispatch buffers and expert rows per iteration: GPipe x expert
        # is not proposed by the search: the compiled step holds ~2.1 x this estimate)
        activations += experts.activation_bytes(
            cost, tokens / micro, value_bytes, remat, e, m,
            layers=micro * stretch * _moe_layers(cost) / s)
        if seq > 1 and context_parallel == "all_gather":
            layers = 1 if remat else dims["num_layers"] / s * stretch
            activations += gathered_kv_bytes(dims, rows, sequence_length, m, value_bytes,
                                             layers)
        pipeline = gathered + (3 if repeats > 1 else 2) * tokens * (
            dims.get("hidden_dim") or 0) * 4
    else:  # one microbatch's chunk (recomputed) and head at a time, the inputs in flight
        from kdist.planning import schedule_memory

        parts = split(cost, sequence_length if mesh.get("seq", 1) == 1 else 1, value_bytes,
                      remat)
        interpreted = schedule_memory.memory(cost, parts, mesh, rows, sequence_length,
                                             value_bytes, schedule, micro, repeats, dims,
                                             context_parallel, remat)
        activations = interpreted["activations"]
        pipeline = gathered + interpreted["pipeline"]
    out = {"parameters": weights,
           "optimizer_state": 2 * weights + (weights if grad_accum > 1 else 0),
           "gradients": weights, "activations": activations,
           "pipeline": pipeline}
    out["total"] = sum(out.values())
    return out


def _sends(schedule: str, stages: int, micro: int, repeats: int) -> int:
    """Activations a stage sends each way per step: GPipe's scan once per iteration, the
    interpreter once per tick of its table."""
    if schedule == "gpipe":
        return repeats * micro + stages - 1
    return schedules.build(schedule, stages, micro, repeats).ticks


def collective_terms(cost: Any, mesh: dict[str, int], micro_batch: float,
                     sequence_length: int, value_bytes: int, dims: dict,
                     microbatches: int | None = None, repeats: int = 1,
                     parameter_bytes: int = 4, gradient_bytes: int | None = None,
                     context_parallel: str = "all_gather", activations: bool = True,
                     schedule: str = "gpipe") -> list:
    """Theoretical ring wire bytes per device of one pipelined micro-step of one replica
    group (``micro_batch`` its sequences), as :class:`kdist.planning.traffic.Traffic`
    terms. With a ``seq`` axis a device's tokens are ``1/s`` of its rows', the gradients
    are summed over ``data x seq``, and every iteration of the stage's blocks exchanges
    one microbatch's keys and values over ``seq`` (bubble iterations too: they compute on
    zeros). GPipe's scan sends one activation each way per iteration; the interpreter of
    the other schedules (:mod:`kdist.parallel.pipeline.interpreter`) at every tick of its table."""
    from kdist.planning.traffic import Traffic, context_terms, needs_dimensions

    d, s, f, m = _sizes(mesh)
    seq, e = mesh.get("seq", 1), mesh.get("expert", 1)
    hidden_dim, num_layers = dims.get("hidden_dim", 0), dims.get("num_layers", 0)
    micro = microbatches or s
    parts = split(cost, sequence_length, value_bytes, False)
    v = vocab_stages(mesh)
    pb = experts.stage_block_values(parts, e)  # a device's experts: 1/e of the routed ones
    routed = parts["routed_parameters"] / e
    po = parts["other_parameters"] + parts["table_parameters"] / v
    g = gradient_bytes or parameter_bytes
    rows = micro_batch / (d * f * e)  # expert splits the rows as data does
    tokens = rows * sequence_length / seq
    iterations = repeats * micro + s - 1
    per_stage = num_layers // (repeats * s)  # blocks a stage applies per iteration
    activation = tokens / micro * hidden_dim * value_bytes  # one microbatch, one device
    # gradients over data x seq; the outputs and the inputs' cotangent over stages; with
    # the vocabulary over stages the embedding's output and the head's input gradient too.
    gpipe = schedule == "gpipe"  # else the interpreter's head: below
    terms = [
        Traffic("all-gather", ("fsdp",), _ring(f) * parameter_bytes * (pb / (s * m)
                                                                         + gpipe * 2 * po / m)),
        Traffic("reduce-scatter", ("fsdp",), _ring(f) * g * (pb / (s * m) + gpipe * po / m)),
        # (the interpreter's head: below)
        # (the routed experts' over data x seq, the other weights' over expert too)
        Traffic("all-reduce", ("data", "seq"), 2 * _ring(d * seq) * g * routed / (s * f * m)),
        Traffic("all-reduce", ("data", "expert", "seq") if e > 1 else ("data", "seq"),
                2 * _ring(d * e * seq) * g * (
                    (pb - routed) / (s * f * m)
                    + (po / (f * m) if schedule == "gpipe" else 0))),
        # GPipe: the stages' output (and, vocabulary over stages, the embedding's output and
        # the head's input gradient) summed over stages; the interpreter: only the
        # embedding's gradient, from stage 0 (the head runs inside, on the last stage).
        Traffic("all-reduce", ("stage",), ((2 + 2 * (v > 1)) if schedule == "gpipe" else 1)
                * 2 * _ring(s) * tokens * hidden_dim * value_bytes),
        Traffic("collective-permute", ("stage",), 2 * _sends(schedule, s, micro, repeats)
                * activation),
    ]
    if not gpipe:  # the head's weights enter the region whole (its loss runs inside, on
        # the last stage): gathered over the axes that split them, once, and their gradient
        # summed over every axis of the region (no reduce-scatter over fsdp)
        head = parts["other_parameters"] + parts["table_parameters"]
        terms += [Traffic("all-gather", ("stage", "fsdp"),
                          _ring(f * v) * parameter_bytes * head / m),
                  Traffic("all-reduce", ("stage", "data", "fsdp", "seq")
                          + (("expert",) if e > 1 else ()),
                          2 * _ring(s * d * f * e * seq) * g * head / m)]
    needs_dimensions(dims, mesh, activations)
    # Layer passes of a stage's blocks: GPipe's scan, a forward and a backward at every
    # iteration (the bubble's too, on zeros); the interpreter, those its tasks run.
    forwards = backwards = iterations
    if schedule != "gpipe":
        from kdist.planning.executed import passes

        forwards, backwards = passes(schedules.build(schedule, s, micro, repeats))
    found = getattr(cost, "experts", None)
    if activations and found and e > 1:  # per pass of a MoE layer: dispatch and combine
        # (a backward: their transposes), each of one microbatch's (E, C, D) buffer
        buffer = experts.rows(found, tokens / micro, e) * hidden_dim * value_bytes
        terms.append(Traffic("all-to-all", ("expert",), 2 * _ring(e) * buffer * (
            forwards + backwards) * found.layers / (repeats * s)))
    if activations and m > 1:  # tensor parallel inside each stage, as the estimate counts
        terms.append(Traffic("all-reduce", ("model",),
                             2 * 2 * _ring(m) * activation * (forwards + backwards) * per_stage
                             + 2 * 2 * _ring(m) * tokens * hidden_dim * value_bytes))
    if activations and seq > 1:
        if context_parallel == "all_gather":  # gathered in a forward, reduced in a backward
            def kv(layer_passes):
                return context_terms(dims, seq, m, rows / micro, sequence_length, value_bytes,
                                     context_parallel, layers=layer_passes * per_stage)

            terms += [kv(forwards)[0], kv(backwards)[1]]
        else:  # ring: every stage runs every tick's kind (kdist.parallel.pipeline.every_stage)
            terms += context_terms(dims, seq, m, rows / micro, sequence_length, value_bytes,
                                   context_parallel, layers=iterations * per_stage)
    return [t for t in terms if t.bytes > 0]


def summary(cost: Any, mesh: dict[str, int], global_batch_size: int, sequence_length: int,
            microbatches: int | None = None, repeats: int = 1, value_bytes: int = 4,
            grad_accum: int = 1, schedule: str = "gpipe") -> dict[str, Any]:
    """The schedule and each stage's share: bubble, blocks per stage, the layers each
    stage holds, per-device training FLOPs of its blocks (useful and in the bubble) and of
    the embedding and head it runs, and the bytes it sends to the next stage per step;
    the schedule's table (:mod:`kdist.parallel.pipeline.schedules`): its microbatches in flight and
    its timeline (up to :data:`TIMELINE_TICKS` ticks).

    FLOPs are the cost model's (matmuls, training = 3 x forward); a device's share of its
    stage group's work: ``/ (d f m)``.
    """
    d, s, f, m = _sizes(mesh)
    micro = microbatches or s
    num_layers = int(getattr(cost, "config", {}).get("num_layers", 0))
    per_stage = num_layers // (repeats * s) if num_layers else 0
    fpt = cost.flops_per_token(sequence_length)
    tokens_step = global_batch_size * sequence_length
    blocks = 3 * (fpt.qkv + fpt.attention + fpt.output_projection + fpt.mlp)
    head = 3 * (fpt.unembedding + fpt.extra)
    devices = d * f * m
    useful = blocks / s * tokens_step / devices
    v = vocab_stages(mesh)
    table = schedules.build(schedule, s, micro, repeats)
    if schedule == "gpipe":  # the scan: forwards of every iteration, then 2 F backwards
        bubble = bubble_fraction(s, micro, repeats)
        step = 3 * (repeats * micro + s - 1) / repeats
    else:  # the interpreter's lockstep ticks, each as long as its costliest task
        program = interpreter.Program(table)
        bubble = interpreter.lockstep_bubble(program)
        step = interpreter.step_forwards(program)
    hidden = int(getattr(cost, "config", {}).get("hidden_dim", 0))
    activation = global_batch_size / grad_accum / (d * f) / micro * sequence_length * hidden
    stages = []
    for i in range(s):
        layers = [(((r * s) + i) * per_stage, ((r * s) + i + 1) * per_stage - 1)
                  for r in range(repeats)]
        stages.append({"stage": i, "layers": layers,
                       "block_flops": useful, "bubble_flops": useful * bubble / (1 - bubble),
                       # GPipe: every stage its share of the vocabulary, outside the
                       # pipeline; the others: the last stage, inside the schedule.
                       "head_flops": head * tokens_step / devices / v if schedule == "gpipe"
                       else head * tokens_step / devices * (i == s - 1)})
    return {
        "schedule": schedule, "ticks": table.ticks, "step_forwards": step,
        "in_flight": [max(table.in_flight(i)) for i in range(s)],
        "timeline": table.timeline() if table.ticks <= TIMELINE_TICKS else None,
        "stages": s, "repeats": repeats, "microbatches": micro, "bubble": bubble,
        "blocks_per_stage": num_layers // s if num_layers else None,
        "iterations": repeats * micro + s - 1,
        "microbatch_rows_per_device": global_batch_size / grad_accum / (d * f) / micro,
        "bytes_to_next_stage": 2 * _sends(schedule, s, micro, repeats) * activation
        * value_bytes * grad_accum,
        "vocabulary_over_stages": v > 1 and schedule == "gpipe",
        "per_stage": stages,
    }


def report_lines(info: dict[str, Any], format_bytes) -> list[str]:
    """The plan's pipeline lines (``kdist plan``)."""
    name = info.get("schedule", "gpipe")
    where = ("the embedding and head run outside the pipeline, on every stage" if name == "gpipe"
             else "the embedding runs on every stage before the schedule, the head and loss "
                  "on the last stage inside it")
    steps = (f"{info['iterations']} iterations; bubble {info['bubble']:.1%} = "
             f"(S-1)/(R*M+S-1) of each stage's iterations compute on zeros" if name == "gpipe"
             else f"{info['ticks']} ticks, each of one forward, input gradient or weight "
                  f"gradient per stage, kinds mixed"
             if name in schedules.SPLIT
             else f"{info['ticks']} ticks, each of forwards only or backwards only")
    if "step_forwards" in info:
        steps += (f"; step ~ {info['step_forwards']:.1f} forwards of a stage" + (
            "" if name == "gpipe" else f" (a backward recomputes its forward: 3), bubble "
                                       f"{info['bubble']:.1%} of the devices' time"))
    lines = [f"pipeline: {name}, {info['stages']} stages x {info['repeats']} repeats, "
             f"{info['microbatches']} microbatches ({info['microbatch_rows_per_device']:g} rows "
             f"per device each), {steps}",
             *([f"  pipeline_schedule auto: {info['choice']}"] if info.get("choice") else []),
             f"  to the next stage per step: {format_bytes(info['bytes_to_next_stage'])} per "
             f"device (activations forward, their gradients backward)",
             f"  microbatch chunks in flight per stage (their inputs kept): "
             f"{info.get('in_flight')}",
             f"  per device of each stage (training FLOPs per step; {where}" + (
                 ", each stage 1/S of the vocabulary):" if info.get("vocabulary_over_stages")
                 else "):")]
    for row in info["per_stage"]:
        layers = ", ".join(f"{a}-{b}" for a, b in row["layers"])
        lines.append(f"    stage {row['stage']}: blocks {layers}: {row['block_flops']:.3g} "
                     f"+ bubble {row['bubble_flops']:.3g}; embedding+head "
                     f"{row['head_flops']:.3g}")
    if info.get("timeline"):
        lines.append("  timeline (F forward, B backward, I input gradient, W weight gradient; "
                     "a letter: the model chunk):")
        lines += ["    " + line for line in info["timeline"].splitlines()]
    elif "ticks" in info:
        lines.append(f"  timeline: {info['ticks']} ticks, longer than the {TIMELINE_TICKS} "
                     f"drawn: kdist.parallel.pipeline.schedules.build({name!r}, {info['stages']}, "
                     f"{info['microbatches']}, {info['repeats']}).timeline()")
    return lines
