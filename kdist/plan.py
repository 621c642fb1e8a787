"""Plan before you pay: per-device memory, FLOPs and collectives of a train step, compiled
on abstract inputs, with a verdict and the smallest change that fits.

:func:`plan` builds the model with **no weights materialised** — every variable is created
inside a ``keras.StatelessScope(initialize_variables=False)``, so Keras records its shape,
dtype and initializer but allocates nothing — gives each variable the layout the kdist
distribution prescribes, builds the optimizer the same way (its slots take their weight's
layout), and lowers the model's own JAX ``train_step`` (``stateless_call`` → loss →
``optimizer.stateless_apply``, exactly what ``fit`` runs) with ``jax.jit(...,
donate_argnums=0, out_shardings=...)`` as Keras' trainer does, on ``ShapeDtypeStruct``
inputs carrying the shardings. XLA then compiles the real per-device program, and we read

* ``memory_analysis()``: argument, output, alias (donated) and temporary bytes per device;
  peak ≈ arguments + outputs − aliased + temporaries;
* ``cost_analysis()``: FLOPs per device, beside :mod:`kdist.flops`' formula;
* the optimized HLO: every collective, by kind (:mod:`kdist.hlo`).

A gpt2-xl (1.5 B parameters) plans on a CPU with a few GB of RAM. The plan is checked
against real runs in ``tests/test_plan.py`` and ``benchmarks/plan_accuracy.py``.

Mesh choice (``mesh="auto"``) and suggestions use an analytic model of memory and
communication (:func:`estimate`, :func:`theoretical_collective_bytes`); the chosen mesh or
suggested change is then compiled to confirm it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from kdist import hlo
from kdist.distribution import KdistDistribution, distribution, parse_mesh

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
    on CPU, the host's physical memory divided among the host devices."""
    import jax

    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(1, jax.local_device_count())


# === Building without weights ===


def build_abstract(model_fn: Callable[[], keras.Model], dist: KdistDistribution | None):
    """Runs ``model_fn()`` with every variable left uninitialised (no memory), then gives
    each variable its layout under ``dist``. Returns the model.

    Keras creates a variable inside a ``StatelessScope`` lazily (shape, dtype, initializer
    only) and would initialise them all when the outermost scope exits; we disable that and
    drop them from Keras' pending list, so nothing is ever allocated for them.
    """
    from keras.src.backend.common import global_state

    with keras.StatelessScope(initialize_variables=False):
        model = model_fn()
    _forget_pending_variables(global_state)
    if dist is not None:
        for v in model.variables:
            v._layout = dist.get_variable_layout(v)  # what Keras does when it initialises
    return model


def _forget_pending_variables(global_state) -> None:
    global_state.set_global_attribute("uninitialized_variables", [])


def _abstract(variables, dist, mesh=None):
    import jax

    out = []
    for v in variables:
        layout = getattr(v, "_layout", None)
        if layout is None and dist is not None:
            layout = dist.get_variable_layout(v)
        if layout is not None:
            sharding = layout.backend_layout
        else:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        out.append(jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=sharding))
    return out


def _shard_bytes(specs) -> int:
    return int(sum(math.prod(s.sharding.shard_shape(s.shape)) * np.dtype(s.dtype).itemsize
                   for s in specs))


def compile_train_step(model: keras.Model, x, y, dist: KdistDistribution | None):
    """Lowers and compiles ``model.train_step`` on abstract state and batch.

    ``model`` is compiled (optimizer, loss) and built abstractly (:func:`build_abstract`);
    ``x`` and ``y`` are arrays or ``ShapeDtypeStruct``s of one (micro-)batch. Returns
    ``(compiled, abstract_state)``; nothing is executed.
    """
    import jax
    from keras.src.backend.common import global_state

    x_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    y_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), y)
    with keras.StatelessScope(initialize_variables=False):
        # Builds the compiled loss and metrics; optimizer slots are created lazily.
        model._symbolic_build(data_batch=(x_spec, y_spec))
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
    _forget_pending_variables(global_state)
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
    return step.lower(state, data).compile(), state


# === Analytic estimates (mesh choice, suggestions, the memory benchmark) ===


def activation_bytes_per_token(config: dict, bytes_per_value: int = 4,
                               remat: bool = False) -> float:
    """Estimated activation bytes kept for the backward pass, per token, for a GPT config.

    Per layer and token (D hidden, F MLP, N heads, T sequence): the block input and two
    norm outputs (3D), queries/keys/values (3D), attention scores and probabilities
    (2NT; with ``attention_chunk_size`` only the softmax's running max and sum, 2N), the
    attention output and its projection (2D), the MLP's up projection and
    activation (2F, 3F gated), its down projection (D). Once per token: the logits and
    their softmax gradient in float32 (2V x 4 bytes). With ``remat`` only each block's input
    is kept, plus one block's activations while it is recomputed.

    Example:
        >>> from kdist.models import GPT_PRESETS
        >>> round(activation_bytes_per_token(GPT_PRESETS["gpt2-small"]) / 2**20, 2)
        2.11
    """
    d, f = config["hidden_dim"], config["intermediate_dim"]
    n, t, v = config["num_heads"], config["max_sequence_length"], config["vocabulary_size"]
    t = config.get("sequence_length", t)
    gated = config.get("mlp_activation") == "swiglu"
    attention = 2 * n * (1 if config.get("attention_chunk_size") else t)
    per_layer = bytes_per_value * (9 * d + attention + (3 if gated else 2) * f)
    logits = 2 * v * 4
    if remat:
        return config["num_layers"] * bytes_per_value * d + per_layer + logits
    return config["num_layers"] * per_layer + logits


def parameter_count(config: dict) -> int:
    """Parameters of a kdist GPT config (exact for GPT-2 and Llama-style configs), padding
    rows of the token table included.

    Example:
        >>> from kdist.models import GPT_PRESETS
        >>> parameter_count(GPT_PRESETS["gpt2-small"])  # token table padded to 50304 rows
        124475904
    """
    d, f = config["hidden_dim"], config["intermediate_dim"]
    multiple = config.get("vocabulary_divisible_by", 1)
    v = -(-config["vocabulary_size"] // multiple) * multiple  # token table rows
    n = config["num_heads"]
    k = config.get("num_key_value_heads") or n
    h = d // n
    bias = config.get("use_bias", True)
    gated = config.get("mlp_activation") == "swiglu"
    norm = 2 * d if config.get("norm", "layer_norm") == "layer_norm" else d
    attention = d * (n + 2 * k) * h + n * h * d + (bias and (n + 2 * k) * h + d)
    mlp = d * f * (3 if gated else 2) + (bias and f * (2 if gated else 1) + d)
    layers = config["num_layers"] * (attention + mlp + 2 * norm)
    embeddings = v * d * (1 if config.get("tie_embeddings", True) else 2)
    positions = 0 if config.get("position_embedding") == "rotary" else (
        config["max_sequence_length"] * d)
    return int(layers + embeddings + positions + norm)


def theoretical_collective_bytes(config: dict, mesh: dict[str, int], global_batch_size: int,
                                 sequence_length: int, compute_bytes: int = 4,
                                 parameter_bytes: int = 4,
                                 gradient_bytes: int | None = None) -> dict[str, float]:
    """The minimum ring wire bytes per device per step, by collective kind, for a strategy.

    With P the parameter bytes, d/f/m the data/fsdp/model axis sizes and
    ``ring(n) = (n-1)/n``:

    * fsdp: all-gather the weights for the forward and again for the backward pass
      (``2 ring(f) P/m``), reduce-scatter the gradients (``ring(f) P/m``);
    * data: all-reduce the (fsdp- and model-sharded) gradients: ``2 ring(d) P/(f m)``;
    * model (Megatron): per layer, all-reduce the activations ``B T D`` after the attention
      output and the MLP down projection in the forward pass, and the input gradients of
      the query/key/value and MLP up projections in the backward pass (4 all-reduces of
      ``2 ring(m) x B_local T D`` bytes), plus the vocabulary-parallel embedding's forward and
      backward all-reduce (2 more), with ``B_local`` the per-replica batch.

    Gradients are reduced in ``gradient_bytes`` per value (default: ``parameter_bytes``; 2
    with ``gradient_reduction="bfloat16"``). Small all-reduces (loss, gradient norm, softmax
    statistics) are not counted.

    Example:
        >>> from kdist.models import GPT_PRESETS
        >>> c = theoretical_collective_bytes(GPT_PRESETS["gpt-nano"], {"data": 8, "fsdp": 1,
        ...                                  "model": 1}, 16, 256)
        >>> c["all-reduce"] == 2 * 7 / 8 * parameter_count(GPT_PRESETS["gpt-nano"]) * 4
        True
    """
    d, f, m = mesh.get("data", 1), mesh.get("fsdp", 1), mesh.get("model", 1)

    def ring(n):
        return (n - 1) / n

    p = parameter_count(config) * parameter_bytes
    g = parameter_count(config) * (gradient_bytes or parameter_bytes)
    out = {"all-gather": 2 * ring(f) * p / m, "reduce-scatter": ring(f) * g / m,
           "all-reduce": 2 * ring(d) * g / (f * m)}
    local_batch = global_batch_size / (d * f)
    activation = local_batch * sequence_length * config["hidden_dim"] * compute_bytes
    out["all-reduce"] += (4 * config["num_layers"] + 2) * 2 * ring(m) * activation
    return {k: v for k, v in out.items() if v > 0}


def estimate(config: dict, mesh: dict[str, int], global_batch_size: int, sequence_length: int,
             *, precision: str = "float32", remat: bool = False, grad_accum: int = 1) -> dict:
    """Analytic per-device bytes (weights, optimizer, gradients, activations) for a GPT on
    a mesh. Weights are float32 (mixed precision keeps float32 variables); activations
    use the compute dtype; gradient accumulation adds a float32 accumulator per weight.

    Example:
        >>> from kdist.models import GPT_PRESETS
        >>> e = estimate(GPT_PRESETS["gpt2-small"], {"data": 1, "fsdp": 8, "model": 1}, 64, 1024)
        >>> e["parameters"] == parameter_count(GPT_PRESETS["gpt2-small"]) * 4 / 8
        True
    """
    shards = mesh.get("fsdp", 1) * mesh.get("model", 1)
    weights = parameter_count(config) * 4 / shards
    micro_batch = global_batch_size / grad_accum / (mesh.get("data", 1) * mesh.get("fsdp", 1))
    per_token = activation_bytes_per_token(
        {**config, "sequence_length": sequence_length},
        2 if precision in ("bf16", "bfloat16", "mixed_bfloat16") else 4, remat)
    out = {
        "parameters": weights,
        "optimizer_state": 2 * weights + (weights if grad_accum > 1 else 0),
        "gradients": weights,
        "activations": micro_batch * sequence_length * per_token / mesh.get("model", 1),
    }
    out["total"] = sum(out.values())
    return out


def candidate_meshes(num_devices: int, config: dict | None, global_batch_size: int,
                     grad_accum: int = 1) -> list[dict[str, int]]:
    """Every (data, fsdp, model) mesh over ``num_devices`` that the model and batch allow.

    Example:
        >>> [m["model"] for m in candidate_meshes(4, None, 8)]
        [1, 1, 1, 2, 2, 4]
    """
    out = []
    for m in range(1, num_devices + 1):
        if num_devices % m:
            continue
        if config and any(config.get(k) and config[k] % m for k in (
                "num_heads", "num_key_value_heads", "intermediate_dim", "vocabulary_size")):
            continue
        for f in range(1, num_devices // m + 1):
            if (num_devices // m) % f:
                continue
            d = num_devices // (m * f)
            if (global_batch_size // grad_accum) % (d * f) or global_batch_size % grad_accum:
                continue
            if config and f > 1 and config["hidden_dim"] % f:
                continue
            out.append({"data": d, "fsdp": f, "model": m})
    return out


def choose_mesh(config: dict, num_devices: int, device_memory: int, global_batch_size: int,
                sequence_length: int, *, precision: str = "float32", remat: bool = False,
                grad_accum: int = 1) -> tuple[dict[str, int], list[dict], str]:
    """The mesh that fits in memory with the least communication per step (analytic).

    Returns ``(mesh, table, why)``: the table has one row per candidate (estimated bytes,
    wire bytes, ranking cost, fits). Communication is ranked with tensor parallelism's
    activation all-reduces counted twice (they sit on the critical path; the gradient
    all-reduce and the weight all-gathers overlap with compute); ties go to fewer
    ``model`` shards. If nothing fits, the candidate with the least memory is returned
    and ``why`` says so.

    Example:
        >>> from kdist.models import GPT_PRESETS
        >>> mesh, _, why = choose_mesh(GPT_PRESETS["gpt-nano"], 8, 2**34, 16, 256)
        >>> mesh
        {'data': 8, 'fsdp': 1, 'model': 1}
    """
    budget = device_memory * USABLE_FRACTION
    rows = []
    for mesh in candidate_meshes(num_devices, config, global_batch_size, grad_accum):
        memory = estimate(config, mesh, global_batch_size, sequence_length,
                          precision=precision, remat=remat, grad_accum=grad_accum)["total"]
        compute_bytes = 2 if precision in ("bf16", "bfloat16", "mixed_bfloat16") else 4
        comm = sum(theoretical_collective_bytes(
            config, mesh, global_batch_size // grad_accum, sequence_length,
            compute_bytes).values()) * grad_accum
        # Tensor parallelism's activation all-reduces sit on the critical path (each layer
        # waits for them); gradient all-reduces and weight all-gathers overlap with compute.
        # So its bytes weigh double when ranking.
        no_tp = {**mesh, "model": 1}
        tp = comm - sum(theoretical_collective_bytes(
            config, no_tp, global_batch_size // grad_accum, sequence_length,
            compute_bytes).values()) * grad_accum / mesh["model"]
        rows.append({"mesh": mesh_spec(mesh), "memory": memory, "wire_bytes": comm,
                     "cost": comm + max(0.0, tp), "fits": memory <= budget, "_mesh": mesh})
    if not rows:
        raise ValueError(
            f"No mesh over {num_devices} devices suits this model and a global batch of "
            f"{global_batch_size}: the batch per step must divide by the data x fsdp axes. "
            f"Use a global batch that is a multiple of {num_devices}.")
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        best = min(fitting, key=lambda r: (r["cost"], r["_mesh"]["model"]))
        why = (f"{best['mesh']}: fits ({format_bytes(best['memory'])} estimated of "
               f"{format_bytes(budget)} usable per device) with the least communication "
               f"({format_bytes(best['wire_bytes'])} per device per step; tensor-parallel "
               f"bytes weigh double) of the {len(fitting)} fitting meshes out of {len(rows)}")
    else:
        best = min(rows, key=lambda r: r["memory"])
        why = (f"no mesh fits {format_bytes(budget)} usable per device; {best['mesh']} needs "
               f"the least ({format_bytes(best['memory'])} estimated)")
    table = [{k: v for k, v in r.items() if k != "_mesh"} for r in rows]
    return best["_mesh"], table, why


def mesh_spec(mesh: dict[str, int]) -> str:
    """``{"data": 1, "fsdp": 8, "model": 1}`` -> ``'fsdp=8'``."""
    return ",".join(f"{a}={s}" for a, s in mesh.items() if s > 1) or "data=1"


# === The plan ===


@dataclasses.dataclass
class Plan:
    """What one train step needs per device, from the compiled program. See :func:`plan`."""

    config: dict[str, Any]
    mesh: dict[str, int]
    parameters: int
    memory: dict[str, float]  # per device: parameters, optimizer_state, gradients, ...
    xla_memory: dict[str, int]  # memory_analysis() fields
    device_memory: int
    flops: dict[str, float]
    collectives: dict[str, dict[str, float]]
    theoretical_collectives: dict[str, float]
    compile_seconds: float
    mesh_choice: str | None = None
    suggestion: dict[str, Any] | None = None

    @property
    def total(self) -> float:
        return self.memory["total"]

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory * USABLE_FRACTION

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(total=self.total, fits=self.fits, usable_fraction=USABLE_FRACTION)
        return out

    def report(self) -> str:
        """The plan as a few lines of text (what ``kdist plan`` prints)."""
        c, m = self.config, self.memory
        lines = [f"plan: {c['model']} ({self.parameters:,} parameters), mesh {mesh_spec(self.mesh)}"
                 f" over {math.prod(self.mesh.values())} devices, global batch "
                 f"{c['global_batch_size']} x {c['sequence_length']}, {c['precision']}, "
                 f"remat {c['remat']}, gradient accumulation {c['grad_accum']}"]
        if self.mesh_choice:
            lines.append(f"mesh auto: {self.mesh_choice}")
        lines.append("memory per device (XLA memory_analysis):")
        for key, label in (("parameters", "parameters"), ("optimizer_state", "optimizer state"),
                           ("gradients", "gradients (in temporaries)"),
                           ("activations_and_temporaries", "activations + other temporaries"),
                           ("batch_and_other", "batch and other arguments"),
                           ("total", "total (peak)")):
            lines.append(f"  {label:<34}{format_bytes(m[key]):>12}")
        lines.append(f"  {'device memory':<34}{format_bytes(self.device_memory):>12}"
                     f"  (plan uses {self.total / self.device_memory:.0%}; budget "
                     f"{USABLE_FRACTION:.0%})")
        f = self.flops
        lines.append(f"FLOPs per optimizer step: XLA {f['xla']:.4g}, formula {f['formula']:.4g} "
                     f"(XLA / formula {f['xla'] / f['formula']:.3f})")
        if self.collectives:
            lines.append("collectives per step (per device; wire = ring bytes sent):")
            empty = {"count": 0, "bytes": 0.0, "wire_bytes": 0.0}
            for kind in hlo.COLLECTIVE_KINDS:
                if kind not in self.collectives and kind not in self.theoretical_collectives:
                    continue
                row = self.collectives.get(kind, empty)
                theory = self.theoretical_collectives.get(kind)
                extra = f", theoretical min {format_bytes(theory)}" if theory else ""
                lines.append(f"  {kind:<20}{int(row['count']):>5} x, {format_bytes(row['bytes'])}"
                             f" logical, {format_bytes(row['wire_bytes'])} wire{extra}")
            actual = sum(r["wire_bytes"] for r in self.collectives.values())
            theory = sum(self.theoretical_collectives.values())
            if theory:
                lines.append(f"  {'total':<20}{'':>8}{format_bytes(actual)} wire, theoretical "
                             f"min {format_bytes(theory)} ({actual / theory:.2f}x; see "
                             f"benchmarks/README.md for why)")
        else:
            lines.append("collectives: none (one device, or nothing sharded)")
        lines.append(f"compile: {self.compile_seconds:.1f} s")
        if self.fits:
            lines.append(f"verdict: FITS — {format_bytes(self.total)} of "
                         f"{format_bytes(self.device_memory)} per device")
        else:
            lines.append(f"verdict: DOES NOT FIT — {format_bytes(self.total)} needed, "
                         f"{format_bytes(self.device_memory * USABLE_FRACTION)} usable")
            s = self.suggestion
            if s:
                how = "compiled" if s.get("verified") else "estimated"
                lines.append(f"suggestion: {s['change']} -> {format_bytes(s['total'])} per "
                             f"device ({how})" + ("" if s.get("fits", True) else
                                                  " — still does not fit"))
            else:
                lines.append("suggestion: none found: use more devices or a smaller model")
        return "\n".join(lines)


def _precision_policy(precision: str) -> str:
    names = {"f32": "float32", "float32": "float32", "bf16": "mixed_bfloat16",
             "bfloat16": "mixed_bfloat16", "mixed_bfloat16": "mixed_bfloat16"}
    if precision not in names:
        raise ValueError(f"Unknown precision {precision!r}. Use 'float32' (or 'f32') or "
                         f"'bfloat16' (or 'bf16', Keras mixed_bfloat16).")
    return names[precision]


def _gpt_model_fn(preset: str, remat: bool, overrides: dict | None):
    from kdist.models import GPTCausalLM

    def build():
        return GPTCausalLM.from_preset(preset, remat=remat, **(overrides or {}))

    return build


def plan(
    model: str | Callable[[], keras.Model] = "gpt-nano",
    mesh: str = "auto",
    global_batch_size: int = 8,
    sequence_length: int | None = None,
    *,
    precision: str = "float32",
    remat: bool | str = False,
    grad_accum: int = 1,
    device_memory: int | str | None = None,
    devices: Sequence | None = None,
    optimizer: Callable[[], Any] | None = None,
    batch: tuple | None = None,
    suggest: bool = True,
    verify: bool = True,
    model_overrides: dict | None = None,
    auto_shard: bool = False,
    gradient_reduction: str | None = None,
) -> Plan:
    """Compiles one train step on abstract inputs and reports what it needs per device.

    Args:
        model: a kdist GPT preset name, or a function returning a Keras model (built under
            the plan's distribution, weights never materialised; compiled with
            ``optimizer`` and sparse categorical cross-entropy unless already compiled).
        mesh: a mesh spec (``"fsdp=8"``, ``"data=2,model=4"``) or ``"auto"``: choose the
            mesh that fits with the least communication (:func:`choose_mesh`).
        global_batch_size, sequence_length: sequences (and tokens each) per optimizer step.
        precision: ``"float32"`` or ``"bf16"`` (Keras ``mixed_bfloat16``).
        remat: ``True`` / ``"block"``: rematerialise each Transformer block.
        grad_accum: micro-batches per step (Keras ``gradient_accumulation_steps``).
        device_memory: bytes (or ``"80GiB"``) per device; default: the device's own.
        batch: ``(x, y)`` arrays or shape structs of one micro-batch (for non-GPT models).
        suggest, verify: if it does not fit, look for the smallest change that does, and
            compile that change to confirm it.
        model_overrides: config fields replacing the preset's (e.g. ``num_layers``).
        auto_shard: shard weights no kdist table names by structure and shape
            (:mod:`kdist.auto_sharding`): for keras-hub or your own models.
        gradient_reduction: the distribution's (``kdist.distribution``): None, ``"float32"``
            or ``"bfloat16"``.

    Example:
        >>> p = plan("gpt-nano", mesh="fsdp=8", global_batch_size=16, sequence_length=128,
        ...          model_overrides={"vocabulary_size": 512})  # doctest: +SKIP
        >>> p.fits, p.memory["parameters"] < p.parameters * 4 / 4  # doctest: +SKIP
        (True, True)
    """
    import jax

    from kdist.flops import model_flops_per_token
    from kdist.models import GPT_PRESETS
    from kdist.models.presets import preset_config
    from kdist.optim import adamw

    if remat not in (False, True, "block", "none", None):
        raise ValueError(f"remat must be False/'none' or True/'block'; got {remat!r}.")
    remat = remat in (True, "block")
    policy = _precision_policy(precision)
    if grad_accum < 1 or global_batch_size % grad_accum:
        raise ValueError(f"grad_accum={grad_accum} must be a positive divisor of "
                         f"global_batch_size={global_batch_size}.")
    devices = list(devices) if devices is not None else jax.devices()
    device_memory = (parse_bytes(device_memory) if device_memory is not None
                     else default_device_memory(devices[0]))
    config = None
    if isinstance(model, str):
        config = preset_config(GPT_PRESETS, model, **(model_overrides or {}))
        sequence_length = sequence_length or config["max_sequence_length"]
        if sequence_length > config["max_sequence_length"]:
            raise ValueError(f"sequence_length={sequence_length} exceeds {model}'s "
                             f"max_sequence_length {config['max_sequence_length']}.")
        model_name, model_fn = model, _gpt_model_fn(model, remat, model_overrides)
    elif callable(model):
        if batch is None and sequence_length is None:
            raise ValueError("For a model function, pass batch=(x, y) of one micro-batch or "
                             "sequence_length (token-id inputs and targets).")
        model_name, model_fn = getattr(model, "__name__", "model"), model
    else:
        raise TypeError(f"model must be a preset name or a function returning a Keras model; "
                        f"got {type(model).__name__}.")

    mesh_choice = None
    if mesh.strip().lower() == "auto":
        if config is None:
            raise ValueError("mesh='auto' needs a kdist preset (its analytic model); for "
                             "other models pass an explicit mesh such as 'fsdp=8'.")
        chosen, _, mesh_choice = choose_mesh(
            config, len(devices), device_memory, global_batch_size, sequence_length,
            precision=policy, remat=remat, grad_accum=grad_accum)
        mesh = mesh_spec(chosen)
    sizes = parse_mesh(mesh, _mesh_devices(mesh, len(devices)))
    num = math.prod(sizes.values())
    if num > len(devices):
        raise ValueError(
            f"Mesh {mesh!r} needs {num} devices but this process has {len(devices)}. On CPU, "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={num} before jax starts "
            f"(the `kdist plan` command does this itself).")
    micro = global_batch_size // grad_accum
    if micro % (sizes["data"] * sizes["fsdp"]):
        raise ValueError(
            f"The micro-batch ({global_batch_size} / {grad_accum} = {micro}) must divide by the "
            f"data x fsdp replicas ({sizes['data'] * sizes['fsdp']}) of mesh {mesh!r}.")

    def run(sizes, remat, grad_accum):
        # A preset is rebuilt with the remat asked for; a model function as it is.
        fn = _gpt_model_fn(model_name, remat, model_overrides) if config else model_fn
        return _compile_plan(fn, sizes, devices, policy, global_batch_size // grad_accum,
                             sequence_length, grad_accum, optimizer or adamw, batch,
                             auto_shard, gradient_reduction)

    start = time.perf_counter()
    compiled, state, model_obj = run(sizes, remat, grad_accum)
    seconds = time.perf_counter() - start
    trainable, _, optimizer_state, _ = state
    memory = _memory_breakdown(compiled, state)
    xla_flops = _xla_flops(compiled) * num * grad_accum
    tokens = global_batch_size * (sequence_length or 0)
    try:
        per_token = model_flops_per_token(config or model_obj, sequence_length)
        formula = (per_token.hardware if remat else per_token.training) * tokens
    except (TypeError, ValueError):
        formula = float("nan")
    collectives = hlo.summarize_collectives(hlo.parse_collectives(compiled.as_text(), num))
    for row in collectives.values():
        row.update(count=row["count"], bytes=row["bytes"] * grad_accum,
                   wire_bytes=row["wire_bytes"] * grad_accum)
    theory = {}
    if config is not None:
        theory = {k: v * grad_accum for k, v in theoretical_collective_bytes(
            config, sizes, micro, sequence_length,
            2 if policy == "mixed_bfloat16" else 4,
            gradient_bytes=2 if gradient_reduction == "bfloat16" else None).items()}
    result = Plan(
        config=dict(model=model_name, mesh=mesh, global_batch_size=global_batch_size,
                    sequence_length=sequence_length, precision=policy, remat=remat,
                    grad_accum=grad_accum),
        mesh=sizes,
        parameters=int(sum(math.prod(s.shape) for s in trainable)),
        memory=memory,
        xla_memory=_xla_memory(compiled),
        device_memory=device_memory,
        flops={"xla": xla_flops, "formula": formula},
        collectives=collectives,
        theoretical_collectives=theory,
        compile_seconds=seconds,
        mesh_choice=mesh_choice,
    )
    if suggest and not result.fits:
        result.suggestion = _suggest(result, config, len(devices),
                                     run if verify else None)
    return result


def _compile_plan(model_fn, sizes, devices, policy, micro_batch, sequence_length, grad_accum,
                  optimizer_fn, batch, auto_shard=False, gradient_reduction=None):
    import jax

    # A fresh Keras session (stable variable paths, the abstract model dropped afterwards);
    # the caller's distribution and dtype policy are put back.
    previous_policy = keras.config.dtype_policy()
    previous_dist = keras.distribution.distribution()
    keras.utils.clear_session()
    num = math.prod(sizes.values())
    dist = (distribution(mesh_spec(sizes), devices[:num], auto_shard=auto_shard,
                         gradient_reduction=gradient_reduction) if num > 1 else None)
    try:
        keras.config.set_dtype_policy(policy)
        keras.distribution.set_distribution(dist)
        model = build_abstract(model_fn, dist)
        if getattr(model, "optimizer", None) is None:
            opt = optimizer_fn()
            if grad_accum > 1:
                opt.gradient_accumulation_steps = grad_accum
            model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
        if batch is None:
            tokens = jax.ShapeDtypeStruct((micro_batch, sequence_length), "int32")
            x, y = tokens, tokens
        else:
            x, y = batch
        compiled, state = compile_train_step(model, x, y, dist)
    finally:
        keras.utils.clear_session()
        keras.config.set_dtype_policy(previous_policy)
        keras.distribution.set_distribution(previous_dist)
    return compiled, state, model


def _mesh_devices(spec: str, available: int) -> int:
    """Devices a mesh spec asks for: the product of its sizes, or all if one is -1."""
    sizes = [part.partition("=")[2].strip() for part in spec.split(",")]
    if spec.strip().lower() in ("auto", "dp", "fsdp", "tp") or "-1" in sizes:
        return available
    try:
        return math.prod(int(s) for s in sizes)
    except ValueError:
        return available  # parse_mesh explains what is wrong


def _xla_memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "alias", "temp", "generated_code")}


def _xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", 0.0))


def _memory_breakdown(compiled, state) -> dict[str, float]:
    """Per-device bytes: the state from the shardings, the rest from memory_analysis()."""
    trainable, non_trainable, optimizer_state, metrics = state
    x = _xla_memory(compiled)
    params = _shard_bytes(trainable) + _shard_bytes(non_trainable)
    opt = _shard_bytes(optimizer_state)
    # Gradients: one float32 shard per trainable weight, live inside XLA's temporaries.
    grads = sum(math.prod(s.sharding.shard_shape(s.shape)) * 4 for s in trainable)
    total = x["argument"] + x["output"] - x["alias"] + x["temp"] + x["generated_code"]
    return {
        "parameters": float(params),
        "optimizer_state": float(opt),
        "gradients": float(grads),
        "activations_and_temporaries": float(max(0, x["temp"] - grads)),
        "batch_and_other": float(x["argument"] - params - opt
                                 + x["output"] - x["alias"] + x["generated_code"]),
        "total": float(total),
    }


def _suggest(result: Plan, config: dict | None, num_devices: int, run) -> dict | None:
    """The smallest change that fits: more fsdp, then gradient accumulation, then remat
    (and their combinations), estimated by scaling the compiled figures, then (if ``run``)
    compiled to confirm. Returns ``{"change", "mesh", "remat", "grad_accum", "total",
    "fits", "verified"}`` or None."""
    c, m = result.config, result.memory
    budget = result.device_memory * USABLE_FRACTION
    state = m["parameters"] + m["optimizer_state"] + m["gradients"]
    activations = m["activations_and_temporaries"]
    other = m["batch_and_other"]
    remat_ratio = 1.0
    if config is not None and not c["remat"]:
        cfg = {**config, "sequence_length": c["sequence_length"]}
        remat_ratio = (activation_bytes_per_token(cfg, remat=True)
                       / activation_bytes_per_token(cfg))
    mesh = dict(result.mesh)
    micro_per_replica = c["global_batch_size"] // c["grad_accum"] // (mesh["data"] * mesh["fsdp"])
    options = []
    fsdp_meshes = [mesh]
    if mesh["data"] > 1:
        fsdp_meshes.append({**mesh, "data": 1, "fsdp": mesh["fsdp"] * mesh["data"]})
    for new_mesh in fsdp_meshes:
        shard = (mesh["fsdp"] * mesh["model"]) / (new_mesh["fsdp"] * new_mesh["model"])
        for remat in ([False, True] if not c["remat"] else [True]):
            for k in (1, 2, 4, 8, 16, 32, 64):
                if k > micro_per_replica or micro_per_replica % k:
                    continue
                accum = c["grad_accum"] * k
                changes = []
                if new_mesh != mesh:
                    changes.append(f"--mesh {mesh_spec(new_mesh)}")
                if remat and not c["remat"]:
                    changes.append("--remat block")
                if k > 1:
                    changes.append(f"--grad-accum {accum} (micro-batch "
                                   f"{c['global_batch_size'] // accum})")
                if not changes:
                    continue
                act = activations * (remat_ratio if remat and not c["remat"] else 1.0) / k
                extra = m["parameters"] * shard if accum > 1 and c["grad_accum"] == 1 else 0
                total = state * shard + extra + act + other
                # Fewest changes first; then fsdp (free in memory terms), accumulation
                # (smaller micro-batches), remat (a third more compute).
                cost = (len(changes), new_mesh == mesh, remat, k)
                options.append((cost, {"change": " ".join(changes), "mesh": mesh_spec(new_mesh),
                                       "remat": remat or c["remat"], "grad_accum": accum,
                                       "total": total, "fits": total <= budget,
                                       "verified": False}))
    fitting = sorted((o for o in options if o[1]["fits"]), key=lambda o: o[0])
    if not fitting:
        best = min(options, key=lambda o: o[1]["total"])[1] if options else None
        return best
    if run is None:
        return fitting[0][1]
    # Compile candidates in order until one really fits (an estimate can be wrong: on
    # XLA:CPU, remat recomputes but does not lower the compiled peak).
    for _, candidate in fitting[:3]:
        sizes = parse_mesh(candidate["mesh"], math.prod(mesh.values()))
        compiled, state_specs, _ = run(sizes, candidate["remat"], candidate["grad_accum"])
        candidate["total"] = _memory_breakdown(compiled, state_specs)["total"]
        candidate["fits"] = candidate["total"] <= budget
        candidate["verified"] = True
        if candidate["fits"]:
            return candidate
    return min((o[1] for o in fitting[:3]), key=lambda c: c["total"])
