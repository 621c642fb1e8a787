"""Loading a Hugging Face checkpoint straight into an already-sharded kdist model.

The order of events (``load_pretrained``):

1. the directory is opened: ``config.json`` and every safetensors *header* (no data);
2. the HF config becomes the kdist config (``gpt2.py`` / ``llama.py`` / ``bert.py``...), the
   caller's overrides on top; the model is built inside
   ``keras.StatelessScope(initialize_variables=False)``, so its variables have shapes and
   (under the active distribution) layouts but **no values** — nothing is allocated and no
   random initialiser runs;
3. every weight is matched to its HF tensor (a :class:`~kdist.models.hf.tensors.TensorMap`
   per weight path; for a stacked ``scan_layers`` weight a
   :class:`~kdist.models.hf.stacked.StackedMap` of every layer's tensor) and every shape
   checked; missing, unexpected or misshapen tensors are one ``ValueError`` naming each,
   before a single value is read;
4. weight by weight, each device's shard is read from the memory-mapped file — only the box
   of the HF tensor that shard needs (of a stack: only the layers the shard holds, a box of
   each) — put on its device, and the shards assembled into the variable's sharded array
   (``jax.make_array_from_single_device_arrays``). A process reads only the shards of its
   own devices; host memory holds one shard at a time (plus the pages of the one tensor
   being read).

The whole model never exists on one device or in one host buffer: the answer to Keras
issue 21634 (a preset is loaded whole on one device before it is sharded).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import keras
import numpy as np

from kdist import _keras_compat
from kdist.models.hf import bert, exported_config, gpt2, llama, mixtral, qwen3_moe, stacked
from kdist.models.hf.checkpoint import HFCheckpoint, read_config
from kdist.models.hf.tensors import TensorMap
from kdist.parallel.layout import current_mesh_shape, divisors

FAMILIES = {family.MODEL_TYPE: family for family in (gpt2, bert, llama, mixtral, qwen3_moe)}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors names of the weights kdist reads


def family_for(model_type: str, cls=None) -> object:
    """The mapping module of ``model_type``, checked against the class that loads it."""
    if model_type not in FAMILIES:
        raise ValueError(f"Unknown Hugging Face model_type {model_type!r}: kdist loads "
                         f"{', '.join(sorted(FAMILIES))} checkpoints.")
    if cls is None:
        return FAMILIES[model_type]
    backbone_class = getattr(cls, "backbone_class", cls)
    accepted = getattr(backbone_class, "hf_model_types", ())
    if model_type not in accepted:
        owners = {"gpt2": "GPTCausalLM / GPTBackbone", "llama": "GPTCausalLM / GPTBackbone",
                  "mixtral": "GPTCausalLM / GPTBackbone",
                  "qwen3_moe": "GPTCausalLM / GPTBackbone",
                  "bert": "BertMaskedLM / BertClassifier / BertBackbone"}
        raise ValueError(f"{cls.__name__} cannot load a {model_type!r} checkpoint (it loads "
                         f"{list(accepted) or 'none'}); use {owners[model_type]}.")
    return FAMILIES[model_type]


def backbone_config(directory: str | os.PathLike) -> dict:
    """The kdist backbone config of a Hugging Face directory's ``config.json`` (what
    ``from_pretrained`` builds, before overrides), without reading any weight.

    Example:
        >>> backbone_config("path/to/gpt2")["num_layers"]   # doctest: +SKIP
        12
    """
    config = read_config(directory)
    return family_config(family_for(config["model_type"]), config, directory)


def family_config(family, config: dict, directory) -> dict:
    """``family.backbone_config(config)``; a field the family needs that the file lacks is a
    ``ValueError`` saying which, and which family the file's fields look like instead."""
    try:
        return family.backbone_config(config)
    except KeyError as e:
        field = e.args[0]
        looks = [name for name, other in FAMILIES.items() if other is not family
                 and all(k in config for k in getattr(other, "REQUIRED", ()))]
        hint = (f"; its fields look like a {' or '.join(repr(n) for n in looks)} config: is "
                f"model_type wrong?" if looks else "")
        raise ValueError(
            f"{Path(directory) / 'config.json'} says model_type {family.MODEL_TYPE!r} but has "
            f"no {field!r} field, which a {family.MODEL_TYPE} config needs (it has "
            f"{sorted(config)[:12]}){hint} Fix model_type or the missing field.") from None


def arguments(cls) -> set[str]:
    """Named constructor arguments of ``cls``."""
    params = inspect.signature(cls.__init__).parameters
    return {n for n, p in params.items() if n != "self"
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


class _Names:
    """Maps a TensorMap's canonical key to the name stored in the checkpoint: the base
    model's prefix (``transformer.``, ``bert.``, ``model.``) may be absent, and BERT's
    LayerNorm may use its TensorFlow-era names."""

    def __init__(self, stored: dict, family):
        self.stored, self.prefix = stored, family.PREFIX
        self.present = "" if not any(k.startswith(self.prefix) for k in stored) else self.prefix
        self.aliases = getattr(family, "ALIASES", ())

    def resolve(self, key: str) -> str | None:
        candidates = [key]
        if key.startswith(self.prefix):
            candidates.insert(0, self.present + key[len(self.prefix):])
        for name in list(candidates):
            candidates += [name[: -len(a)] + b for a, b in self.aliases if name.endswith(a)]
        return next((c for c in candidates if c in self.stored), None)


def _check_mesh(config: dict, family) -> None:
    """BERT's token table has no padding rows: a vocabulary the model axis does not
    divide is refused here, with the mesh sizes that work (GPT pads, see gpt2.py)."""
    model_axis = current_mesh_shape()["model"]
    vocabulary = config["vocabulary_size"]
    if family is bert and vocabulary % model_axis:
        raise ValueError(
            f"This BERT checkpoint's vocabulary of {vocabulary} tokens does not divide by the "
            f"'model' mesh axis of size {model_axis}, and kdist's BertBackbone has no padded "
            f"token table. Use a 'model' size among {divisors(vocabulary)} (e.g. shard over "
            f"fsdp instead: kdist.distribution('fsdp=N')).")


def is_statistic(family, path: str) -> bool:
    """Whether kdist variable ``path`` is a statistic the family keeps out of its
    checkpoints (a MoE layer's expert load), neither loaded nor exported."""
    pattern = getattr(family, "STATISTICS", None)
    return pattern is not None and pattern.fullmatch(path) is not None


def plan_load(model, family, config: dict, ckpt: HFCheckpoint):
    """``[(variable, map, stored names or None)]`` for every weight, or one ValueError
    naming every missing, unexpected and misshapen tensor. The map is a ``TensorMap``, or a
    ``StackedMap`` for a stacked (``scan_layers``) weight, whose every layer's tensor is
    checked; the names are those of its tensors in the checkpoint. None: an optional weight
    (a head or pooler) absent from the checkpoint, which keeps its initialisation."""
    names = _Names(ckpt.tensors, family)
    plan, problems, used = [], [], set()
    for variable in model.weights:
        path = variable.path
        if is_statistic(family, path):  # not a weight: keeps its initialiser
            continue
        tensor_map = stacked.fitted(family.tensor_map(path, config), variable.shape)
        if tensor_map is None:
            problems.append(f"kdist weight '{path}' {tuple(variable.shape)} has no "
                            f"{family.MODEL_TYPE} tensor (an option kdist cannot load yet, "
                            f"e.g. fused_qkv=True?)")
            continue
        if tensor_map.shape != tuple(variable.shape):
            problems.append(f"kdist weight '{path}' has shape {tuple(variable.shape)} but "
                            f"'{stacked.parts(tensor_map)[0].key}' maps to {tensor_map.shape}")
            continue
        found = []
        for part in stacked.parts(tensor_map):
            name = names.resolve(part.key)
            if name is not None and ckpt.shape(name) != part.hf_shape:
                problems.append(f"tensor '{name}' has shape {ckpt.shape(name)} in the "
                                f"checkpoint but this model needs {part.hf_shape} (for "
                                f"'{path}' {tuple(variable.shape)})")
            if name is not None and ckpt.tensors[name][2] not in FLOAT_DTYPES:
                problems.append(f"tensor '{name}' is stored as {ckpt.tensors[name][2]}, not a "
                                f"floating-point type ({', '.join(FLOAT_DTYPES)}): a weight "
                                f"cast from integers is not the model that was saved "
                                f"(quantised checkpoints are not supported)")
            found.append(name)
        missing = [part for part, name in zip(stacked.parts(tensor_map), found) if name is None]
        if len(missing) == len(found) and path.startswith(family.OPTIONAL):
            plan.append((variable, tensor_map, None))
            continue
        problems += [f"tensor '{part.key}' {part.hf_shape} (for '{path}') is missing"
                     for part in missing]
        used.update(name for name in found if name is not None)
        plan.append((variable, tensor_map, tuple(found)))
    ignorable = [getattr(family, "IGNORED", None), getattr(family, "HEADS", None)]
    tied = names.resolve("lm_head.weight") if config.get("tie_embeddings") else None
    unexpected = sorted(k for k in ckpt.tensors if k not in used and k != tied
                        and not any(p is not None and p.fullmatch(k) for p in ignorable))
    problems += [f"tensor '{k}' {ckpt.shape(k)} is unexpected (no kdist weight takes it)"
                 for k in unexpected]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more"
                                           if len(problems) > 8 else "")
        raise ValueError(
            f"The checkpoint {ckpt.directory} does not fit {type(model).__name__} built from "
            f"its config.json (with your overrides): {shown}. Check that config.json belongs "
            f"to these weights and that no override changes a shape.")
    return plan


class _TensorReader:
    """``reader(key, box)`` over a checkpoint: opens (memory-maps) the tensor each read
    names, keeping the last one open, so a weight read from one tensor maps it once and a
    stacked weight maps each layer's tensor in turn; everything is unmapped on exit."""

    def __init__(self, ckpt: HFCheckpoint, names: _Names):
        self.ckpt, self.names = ckpt, names
        self.stack = contextlib.ExitStack()
        self.name, self.read = None, None

    def __enter__(self):
        return self

    def __call__(self, key: str, box: tuple[slice, ...]) -> np.ndarray:
        name = self.names.resolve(key)
        if name != self.name:  # the previous tensor's pages are released
            self.stack.close()
            self.name, self.read = name, self.stack.enter_context(self.ckpt.opened(name))
        return self.read(box)

    def __exit__(self, *exc):
        self.stack.close()
        return False


def shard_boxes(shape: tuple[int, ...], sharding) -> dict[tuple, list]:
    """``{box: [devices]}`` for this process's devices (a box held by several devices —
    replicated over an axis — is read once)."""
    boxes: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        box = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        boxes.setdefault(box, []).append(device)
    return boxes


def place(tensor_map: TensorMap | stacked.StackedMap, reader, shape: Sequence[int], dtype,
          sharding):
    """The variable's value as a sharded ``jax.Array``, read one device shard at a time."""
    import jax

    shape = tuple(shape)
    if sharding is None:
        return jax.device_put(np.asarray(tensor_map.read(reader), dtype))
    arrays = []
    for box, devices in shard_boxes(shape, sharding).items():
        host = np.asarray(tensor_map.read(reader, tuple(slice(a, b) for a, b in box)), dtype)
        arrays += [jax.device_put(host, device) for device in devices]
        del host  # one shard on the host at a time
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def load_pretrained(cls, directory: str | os.PathLike, **kwargs):
    """``cls`` (a kdist task or backbone class) with the weights of the HF checkpoint in
    ``directory``, built and placed under the active distribution. ``kwargs``: the task's
    constructor arguments (e.g. ``num_classes``), then backbone fields overriding the
    config's (``dropout``, ``remat``, ``vocabulary_divisible_by`` ...)."""
    ckpt = HFCheckpoint(directory)
    family = family_for(ckpt.config["model_type"], cls)
    backbone_class = getattr(cls, "backbone_class", cls)
    is_task = backbone_class is not cls
    task_args = {}
    if is_task:
        accepted = arguments(cls) - {"backbone"}
        task_args = {k: kwargs.pop(k) for k in list(kwargs) if k in accepted}
        if hasattr(family, "task_arguments"):
            task_args.update(family.task_arguments(ckpt.config, ckpt.tensors, accepted,
                                                   task_args))
    unknown = sorted(set(kwargs) - arguments(backbone_class) - {"dtype", "name"})
    if unknown:
        raise TypeError(f"{cls.__name__}.from_pretrained got unknown arguments {unknown}; it "
                        f"takes the task's arguments and {backbone_class.__name__} fields.")
    config = {**family_config(family, ckpt.config, ckpt.directory), **kwargs}
    _check_mesh(config, family)
    pending = _keras_compat.pending_variable_count()  # a caller's own stay as they are
    try:
        with keras.StatelessScope(initialize_variables=False):  # shapes, no values
            backbone = backbone_class(**config)
            model = cls(backbone, **task_args) if is_task else backbone
        mapping_config = {**backbone_class.full_config(config), **task_args}
        if hasattr(family, "check_model"):
            family.check_model(mapping_config, {w.path for w in model.weights})
        plan = plan_load(model, family, mapping_config, ckpt)
        distribution = keras.distribution.distribution()
        for variable in model.variables:
            if distribution is not None:
                _keras_compat.set_variable_layout(
                    variable, distribution.get_variable_layout(variable))
        names = _Names(ckpt.tensors, family)
        for variable, tensor_map, stored in plan:
            if stored is None:
                continue
            layout = _keras_compat.variable_layout(variable)
            sharding = getattr(layout, "backend_layout", layout)
            with _TensorReader(ckpt, names) as read:
                variable.assign(place(tensor_map, read, variable.shape, variable.dtype,
                                      sharding))
    except BaseException:  # refused: nothing was allocated, and nothing is left pending
        _keras_compat.forget_pending_variables(pending)
        raise
    # Weights not in the checkpoint (optional heads), dropout seeds: their initialisers.
    _keras_compat.initialize_pending_variables(pending)
    absent = [v.path for v, _, stored in plan if stored is None]
    if absent:
        warnings.warn(f"{len(absent)} weights of {cls.__name__} are not in {ckpt.directory} "
                      f"and keep their random initialisation: {absent[:6]}"
                      f"{' ...' if len(absent) > 6 else ''} (a head the checkpoint does not "
                      f"have: train it).", stacklevel=3)
    exported_config.remember_source(model, ckpt.config)  # an export keeps its fields
    return model


def checkpoint_bytes(ckpt: HFCheckpoint) -> tuple[int, int]:
    """(total bytes, largest tensor's bytes) of a checkpoint's tensors."""
    sizes = [ckpt.nbytes(k) for k in ckpt.tensors]
    return int(math.fsum(sizes)), max(sizes, default=0)
