"""Compiling the real train step on abstract inputs: no weight is ever allocated.

:func:`build_abstract` builds the model with every variable created inside a
``keras.StatelessScope(initialize_variables=False)`` — Keras records its shape, dtype and
initializer but allocates nothing — and gives each variable the layout the kdist
distribution prescribes; the optimizer is built the same way (its slots take their weight's
layout). :func:`compile_train_step` lowers the model's own JAX ``train_step``
(``stateless_call`` → loss → ``optimizer.stateless_apply``, exactly what ``fit`` runs) with
``jax.jit(..., donate_argnums=0, out_shardings=...)`` as Keras' trainer does, on
``ShapeDtypeStruct`` inputs carrying the shardings. XLA then compiles the real per-device
program, read by :func:`xla_memory` (``memory_analysis()``), :func:`xla_flops`
(``cost_analysis()``) and :func:`memory_breakdown`.

Example:
    >>> import keras
    >>> from kdist.models import GPTCausalLM
    >>> lm = build_abstract(lambda: GPTCausalLM.from_preset("gpt-nano", num_layers=1), None)
    >>> lm.compile(optimizer="adamw", loss=keras.losses.SparseCategoricalCrossentropy(True))
    >>> compiled, _ = compile_train_step(lm, *token_batch(2, 16), None)
    >>> xla_flops(compiled) > 0
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from kdist import _keras_compat
from kdist.compiled_step import ProgramMemory
from kdist.parallel.layout import KdistDistribution, distribution


def build_abstract(model_fn: Callable[[], keras.Model], dist: KdistDistribution | None):
    """Runs ``model_fn()`` with every variable left uninitialised (no memory), then gives
    each variable its layout under ``dist``. Returns the model.

    Keras creates a variable inside a ``StatelessScope`` lazily (shape, dtype, initializer
    only) and would initialise them all when the outermost scope exits; we disable that and
    drop them from Keras' pending list, so nothing is ever allocated for them.
    """
    with keras.StatelessScope(initialize_variables=False):
        model = model_fn()
    _keras_compat.forget_pending_variables()
    if dist is not None:
        for v in model.variables:  # what Keras does when it initialises a variable
            _keras_compat.set_variable_layout(v, dist.get_variable_layout(v))
    return model


def _abstract(variables, dist):
    import jax

    out = []
    for v in variables:
        layout = _keras_compat.variable_layout(v)
        if layout is None and dist is not None:
            layout = dist.get_variable_layout(v)
        if layout is not None:
            sharding = layout.backend_layout
        else:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        out.append(jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=sharding))
    return out


def shard_bytes(specs) -> int:
    """Bytes of one device's shards of ``ShapeDtypeStruct``s that carry a sharding."""
    return int(sum(math.prod(s.sharding.shard_shape(s.shape)) * np.dtype(s.dtype).itemsize
                   for s in specs))


def token_batch(batch_size: int, sequence_length: int) -> tuple:
    """``(x, y)`` shape structs of a causal LM's batch: token ids and next-token targets.

    Example:
        >>> token_batch(2, 16)[0].shape
        (2, 16)
    """
    import jax

    tokens = jax.ShapeDtypeStruct((batch_size, sequence_length), "int32")
    return tokens, tokens


def abstract_batch(model: keras.Model, batch_size: int, sequence_length: int) -> tuple:
    """``(x, y)`` shape structs of one batch, read from the model's structure.

    A model with one input takes token ids and next-token targets (:func:`token_batch`). A
    functional model with several inputs gets each input with its unknown dimensions after
    the batch set to ``sequence_length``, and integer targets shaped as its output without
    the last (class) axis — e.g. a masked LM's mask positions cover every token then (pass
    ``plan(..., batch=...)`` for the real shapes).
    """
    import jax

    try:
        inputs = model.input  # a functional model's input structure
    except (AttributeError, ValueError):  # a subclassed model: no declared inputs
        inputs = None
    if not isinstance(inputs, dict) or len(inputs) < 2:
        return token_batch(batch_size, sequence_length)

    def spec(tensor, dtype=None):
        shape = (batch_size,) + tuple(sequence_length if d is None else d
                                      for d in tensor.shape[1:])
        return jax.ShapeDtypeStruct(shape, dtype or tensor.dtype)

    x = {name: spec(tensor) for name, tensor in inputs.items()}
    output = model.output
    y = jax.ShapeDtypeStruct((batch_size,) + tuple(
        sequence_length if d is None else d for d in output.shape[1:-1]), "int32")
    return x, y


def compile_train_step(model: keras.Model, x, y, dist: KdistDistribution | None):
    """Lowers and compiles ``model.train_step`` on abstract state and batch.

    ``model`` is compiled (optimizer, loss) and built abstractly (:func:`build_abstract`);
    ``x`` and ``y`` are arrays or ``ShapeDtypeStruct``s of one (micro-)batch. Returns
    ``(compiled, abstract_state)``; nothing is executed.
    """
    import jax

    x_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    y_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), y)
    with keras.StatelessScope(initialize_variables=False):
        # Builds the compiled loss and metrics; optimizer slots are created lazily.
        _keras_compat.symbolic_build(model, (x_spec, y_spec))
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
    _keras_compat.forget_pending_variables()
    groups = (model.trainable_variables, model.non_trainable_variables,
              model.optimizer.variables, model.metrics_variables)
    state = tuple(_abstract(g, dist) for g in groups)
    shardings = tuple([s.sharding for s in g] for g in state)

    def batch_spec(a):
        if dist is None:
            return jax.ShapeDtypeStruct(a.shape, a.dtype)
        layout = dist.get_data_layout(a.shape).backend_layout
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=layout)

    data = (jax.tree.map(batch_spec, x_spec), jax.tree.map(batch_spec, y_spec))
    # As keras/src/backend/jax/trainer.py's make_train_function: donated state, state
    # outputs pinned to the state's shardings.
    step = jax.jit(model.train_step, donate_argnums=0, out_shardings=(None, shardings))
    with _lowering_for(dist):
        return step.lower(state, data).compile(), state


def _lowering_for(dist: KdistDistribution | None):
    """Pallas kernels ask JAX's default device what chip they lower for (its VMEM, its
    tiling): a step compiled ahead of time for another platform (a TPU topology's devices
    from a CPU) names the distribution's first device as that default while it lowers."""
    import contextlib

    import jax

    if dist is None:
        return contextlib.nullcontext()
    device = dist.device_mesh.backend_mesh.devices.flat[0]
    if device.platform == jax.default_backend():
        return contextlib.nullcontext()
    return jax.default_device(device)


def compile_plan(model_fn, parallelism, devices, policy, micro_batch, sequence_length,
                 grad_accum, optimizer_fn, batch, auto_shard=False):
    """Builds ``model_fn()`` abstractly under ``parallelism`` (a
    :class:`kdist.parallel.config.Parallelism`: the mesh and every feature's settings) and
    precision ``policy``, compiles it (``optimizer_fn()`` and sparse categorical
    cross-entropy on logits, unless it is compiled already) and compiles its train step on
    ``batch`` (default: :func:`abstract_batch`). Under DiLoCo the program compiled is a
    sync step's: each group's inner step and the average across groups.
    Returns ``(compiled, abstract_state, model)``.

    A fresh Keras session is used (stable variable paths, the abstract model dropped
    afterwards); the caller's distribution and dtype policy are put back.
    """
    import jax

    previous_policy = keras.config.dtype_policy()
    previous_dist = keras.distribution.distribution()
    keras.utils.clear_session()
    num = math.prod(parallelism.mesh.values())
    # Devices of a TPU topology (kdist.planning.target) are not this process's: nothing can
    # be placed on them, and one device of them still needs a mesh to compile for.
    foreign = devices[0] not in set(jax.devices())
    dist = (distribution(parallelism, devices[:num], auto_shard=auto_shard)
            if num > 1 or foreign else None)
    try:
        keras.config.set_dtype_policy(policy)
        keras.distribution.set_distribution(dist)
        model = build_abstract(model_fn, dist)
        if getattr(model, "optimizer", None) is None:
            # The optimizer's step counter is created with a value, which Keras would place
            # on the mesh's devices: a TPU topology compiled for from a CPU (no device to
            # hold it) cannot take it. Made off the mesh, it gets its layout in _abstract.
            keras.distribution.set_distribution(None)
            opt = optimizer_fn()
            keras.distribution.set_distribution(dist)
            if grad_accum > 1:
                opt.gradient_accumulation_steps = grad_accum
            with _abstract_scope(foreign):  # the loss tracker, optimizer slots: no memory
                model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
        x, y = batch if batch is not None else abstract_batch(model, micro_batch,
                                                              sequence_length)
        compiled, state = compile_train_step(model, x, y, dist)
    finally:
        keras.utils.clear_session()
        keras.config.set_dtype_policy(previous_policy)
        keras.distribution.set_distribution(previous_dist)
    return compiled, state, model


@contextlib.contextmanager
def _abstract_scope(abstract: bool):
    """Variables created inside are left uninitialised (no memory, no device) when
    ``abstract``; else nothing changes."""
    if not abstract:
        yield
        return
    with keras.StatelessScope(initialize_variables=False):
        yield
    _keras_compat.forget_pending_variables()


def xla_memory(compiled) -> dict[str, int]:
    """``memory_analysis()`` of a compiled program: argument, output, alias, temp and
    generated-code bytes per device (:class:`kdist.compiled_step.ProgramMemory`)."""
    return dataclasses.asdict(ProgramMemory.of(compiled))


def xla_flops(compiled) -> float:
    """``cost_analysis()["flops"]`` of a compiled (per-device) program, with the matmuls of
    loop bodies counted once per iteration: XLA counts a ``while`` body once, which for a
    scanned layer stack or a pipeline's schedule leaves out most of the step
    (``kdist.hlo.matmul_flops``; the loops' element-wise ops stay counted once)."""
    from kdist import hlo

    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
        cost = cost[0]
    text = compiled.as_text()
    loops = hlo.matmul_flops(text) - hlo.matmul_flops(text, per_iteration=False)
    return float(cost.get("flops", 0.0)) + loops


def memory_breakdown(compiled, state) -> dict[str, float]:
    """Per-device bytes: the state from the shardings, the rest from memory_analysis()."""
    trainable, non_trainable, optimizer_state, metrics = state
    x = xla_memory(compiled)
    params = shard_bytes(trainable) + shard_bytes(non_trainable)
    opt = shard_bytes(optimizer_state)
    # Gradients: one float32 shard per trainable weight, live inside XLA's temporaries.
    grads = sum(math.prod(s.sharding.shard_shape(s.shape)) * 4 for s in trainable)
    # The compiled step's peak, the same sum the Throughput callback logs.
    total = ProgramMemory(**x).peak
    return {
        "parameters": float(params),
        "optimizer_state": float(opt),
        "gradients": float(grads),
        "activations_and_temporaries": float(max(0, x["temp"] - grads)),
        "batch_and_other": float(x["argument"] - params - opt
                                 + x["output"] - x["alias"] + x["generated_code"]),
        "total": float(total),
    }


def xla_train_step_flops(model: Any, batch_size: int, sequence_length: int,
                         batch: Any = None) -> float:
    """FLOPs of one compiled Keras train step, from XLA's ``cost_analysis()``.

    ``model`` must be compiled (loss and optimizer). Lowers the model's own JAX
    ``train_step`` on abstract inputs (``ShapeDtypeStruct``), so only compilation runs,
    and returns XLA's FLOP count for one step of ``batch_size`` sequences. XLA counts every
    op: matmuls, but also norms, softmax, activations, the loss and the optimizer update,
    so it exceeds :func:`kdist.flops.transformer_flops_per_token` by a few percent. Run it
    without a distribution (one device) to get the whole step's count. ``batch`` is a
    sample batch (``(x, y)`` or ``(x, y, sample_weight)``, any nesting of arrays: e.g.
    BERT's input dict) whose shapes and dtypes the step is compiled for; by default
    ``(ids, ids)`` of ``batch_size x sequence_length`` int32 token ids, a causal LM's.

    Example:
        >>> from kdist.models import GPTCausalLM
        >>> lm = GPTCausalLM.from_preset("gpt-nano", vocabulary_size=512, num_layers=1)
        >>> lm.compile(optimizer="adamw")
        >>> xla_train_step_flops(lm, batch_size=2, sequence_length=32) > 0
        True
    """
    import jax

    if getattr(model, "optimizer", None) is None:
        raise ValueError("model is not compiled: call model.compile(optimizer=..., loss=...) "
                         "before xla_train_step_flops(model, ...).")
    if batch is None:
        tokens = np.zeros((batch_size, sequence_length), "int32")
        batch = (tokens, tokens)
    batch = tuple(batch)
    _keras_compat.symbolic_build(model, batch)  # builds loss/metric state, no compute
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                            _keras_compat.jax_state(model))
    abstract_batch_ = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), batch)
    compiled = jax.jit(model.train_step).lower(abstract, abstract_batch_).compile()
    return xla_flops(compiled)
