"""Writing a (sharded) kdist model as a Hugging Face checkpoint, one tensor at a time.

``export(model, directory)`` writes ``config.json`` and safetensors weights — one
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json`` above ``max_shard_bytes`` — in the layout ``transformers``
reads (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MixtralForCausalLM``,
``Qwen3MoeForCausalLM``, ``BertForMaskedLM``, ``BertForSequenceClassification``,
``BertModel``), plus the tokenizer's files when one is given
(:mod:`kdist.models.hf.tokenizers`).

Every header is known before any value (shapes and dtypes come from the variables), so each
file is streamed: its header first, then each tensor as it is gathered. A tensor is built
from the kdist weights that map to it (GPT-2's ``c_attn`` from query, key and value),
gathered from their shards; the host holds one HF tensor (and its parts) at a time, never
the model. A stacked (``scan_layers``) weight is written as its layers' own tensors
(``h.<i>...``), each gathered from its slice of the stack. The safetensors package's
writers take a complete ``{name: array}`` dict — the whole model in memory — which is
why kdist writes the (documented, simple) format itself; files are written under
temporary names and renamed when complete, the index and config last. With several
processes every process takes part in each gather (``process_allgather``) and process 0
writes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kdist.models.hf import exported_config, loading, stacked
from kdist.models.hf.checkpoint import CONFIG, INDEX, WEIGHTS
from kdist.models.hf.tensors import TensorMap, assemble

_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")
GENERATION_CONFIG = "generation_config.json"
GPT2_DEFAULT_TOKEN = 50256  # what transformers assumes when config.json names no token ids


def export_family(backbone):
    """The HF family a kdist backbone's config fits, or a ValueError saying why none."""
    if not getattr(type(backbone), "hf_model_types", ()):
        raise ValueError(f"{type(backbone).__name__} is not a kdist model with a Hugging Face "
                         f"format; kdist exports GPTCausalLM, BertMaskedLM, BertClassifier and "
                         f"their backbones.")
    config = _backbone_config(backbone)
    reasons = {}
    for model_type in type(backbone).hf_model_types:
        family = loading.FAMILIES[model_type]
        wrong = family.matches(config)
        if not wrong:
            return family
        reasons[model_type] = wrong
    raise ValueError(f"{type(backbone).__name__} with this config has no Hugging Face "
                     f"equivalent: " + "; ".join(f"as {k}: {', '.join(v)}"
                                                 for k, v in reasons.items()))


def _backbone_config(backbone) -> dict:
    config = type(backbone).full_config(backbone.get_config())
    return {k: v for k, v in config.items() if k not in ("name", "trainable", "dtype")}


def _mapping_config(model, backbone) -> dict:
    config = _backbone_config(backbone)
    if model is not backbone:
        config.update({k: getattr(model, k) for k in loading.arguments(type(model))
                       if k != "backbone" and hasattr(model, k)})
    return config


def _gather(value) -> np.ndarray:
    """The whole of a (sharded) array on the host: every process joins the gather."""
    if getattr(value, "is_fully_addressable", True):
        return np.asarray(value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def _plan(model, family, config) -> dict[str, list[tuple[TensorMap, object, tuple | None]]]:
    """``{HF key: [(TensorMap, variable, layer index or None), ...]}`` in the model's weight
    order; a stacked weight (``scan_layers``) is one entry per layer, under each layer's
    own key, with the leading index of its layer in the stack — ordered layer by layer
    where the stack stands, as an unstacked model's blocks are."""
    entries, stack_at, previous = [], None, None
    for n, variable in enumerate(model.weights):
        if loading.is_statistic(family, variable.path):
            continue
        tensor_map = stacked.fitted(family.tensor_map(variable.path, config), variable.shape)
        if tensor_map is None or tensor_map.shape != tuple(variable.shape):
            raise ValueError(f"kdist weight '{variable.path}' {tuple(variable.shape)} has no "
                             f"{family.MODEL_TYPE} tensor: this model cannot be exported.")
        if isinstance(tensor_map, stacked.StackedMap):
            # One run of stacked weights is written index by index (a scan_layers stack
            # layer by layer; a MoE layer's gate, up, down expert by expert).
            stack_at = n if not isinstance(previous, stacked.StackedMap) else stack_at
            entries += [((stack_at, i, n), layer, variable, tensor_map.layer_index(i))
                        for i, layer in enumerate(tensor_map.layers)]
        else:
            entries.append(((n, 0, 0), tensor_map, variable, None))
        previous = tensor_map
    groups: dict[str, list] = {}
    for _, tensor_map, variable, layer in sorted(entries, key=lambda e: e[0]):
        groups.setdefault(tensor_map.key, []).append((tensor_map, variable, layer))
    return groups


def _shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    files, current, used = [], [], 0
    for key, size in sizes.items():
        if current and used + size > limit:
            files.append(current)
            current, used = [], 0
        current.append(key)
        used += size
    return files + [current] if current else files


def _header(keys: Iterable[str], shapes: dict, dtype: str, metadata: dict) -> bytes:
    header, offset = {}, 0
    itemsize = np.dtype(_numpy(dtype)).itemsize
    for key in keys:
        size = math.prod(shapes[key]) * itemsize
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shapes[key]),
                       "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def _numpy(dtype: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def export(model, directory: str | os.PathLike, tokenizer=None, dtype: str = "float32",
           max_shard_bytes: int = DEFAULT_SHARD_BYTES, label_names=None) -> Path:
    """Writes ``model`` (a kdist task or backbone, sharded or not) as a Hugging Face
    checkpoint in ``directory``; returns the directory.

    Args:
        tokenizer: a keras-hub ``BytePairTokenizer`` or ``WordPieceTokenizer`` whose files
            (``tokenizer.json`` / ``vocab.json`` + ``merges.txt`` / ``vocab.txt``) go beside
            the weights, so the directory is complete for ``from_pretrained`` and for
            ``transformers`` (which then gives the same ids); its special tokens' ids go
            into ``config.json`` (and a causal LM's ``generation_config.json``). None
            writes weights and config only.
        dtype: of the stored tensors: ``"float32"`` (exact) or ``"bfloat16"``/``"float16"``.
        max_shard_bytes: above this, weights are split into shards with an index.
        label_names: a classifier's class names, in class order (``id2label``).

    A model loaded with ``from_pretrained`` keeps its source ``config.json``'s fields
    (:mod:`kdist.models.hf.exported_config`).

    Example:
        >>> lm = kdist.models.GPTCausalLM.from_preset("gpt-nano", vocabulary_size=512)
        >>> export(lm, "/tmp/gpt-nano-hf")          # doctest: +SKIP
        PosixPath('/tmp/gpt-nano-hf')
    """
    import jax

    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_ST_DTYPES)}; got {dtype!r}.")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive int; got {max_shard_bytes!r}.")
    backbone = getattr(model, "backbone", model)
    family = export_family(backbone)
    config = _mapping_config(model, backbone)
    hf_config = _hf_config(model, family, config, tokenizer, label_names, dtype)
    groups = _plan(model, family, config)
    shapes = {key: group[0][0].hf_shape for key, group in groups.items()}
    itemsize = np.dtype(_numpy(dtype)).itemsize
    files = _shards({k: math.prod(s) * itemsize for k, s in shapes.items()}, max_shard_bytes)
    names = ([WEIGHTS] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    writer = jax.process_index() == 0
    directory = Path(directory).expanduser()
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
        # An earlier export's weights must not mix with these.
        for stale in [directory / WEIGHTS, directory / INDEX,
                      *directory.glob("model-*-of-*.safetensors")]:
            stale.unlink(missing_ok=True)
    for name, keys in zip(names, files):
        _write_file(directory / name, keys, groups, shapes, dtype, writer)
    if writer:
        if len(files) > 1:
            total = sum(math.prod(s) * itemsize for s in shapes.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: n for n, keys in zip(names, files) for k in keys}}
            _atomic_text(directory / INDEX, json.dumps(index, indent=2))
        if tokenizer is not None:
            from kdist.models.hf.tokenizers import save_tokenizer

            save_tokenizer(tokenizer, directory, config["max_sequence_length"])
        if family.MODEL_TYPE != "bert":  # what transformers' generate() reads
            _atomic_text(directory / GENERATION_CONFIG,
                         json.dumps(exported_config.generation_config(hf_config), indent=2))
        _atomic_text(directory / CONFIG, json.dumps(hf_config, indent=2))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("kdist.hf.export")
    return directory


def _hf_config(model, family, config: dict, tokenizer, label_names, dtype: str) -> dict:
    """``config.json``: the family's fields, the source's kept where they read the same,
    the tokenizer's token ids, a classifier's labels, the stored dtype."""
    paths = {w.path for w in model.weights}
    generated = (family.hf_config(config, paths) if family.MODEL_TYPE == "bert"
                 else family.hf_config(config))
    source = exported_config.source_config(model)
    generated.update(exported_config.token_ids(tokenizer))
    if (family.MODEL_TYPE == "gpt2" and "eos_token_id" not in generated
            and not (source or {}).get("eos_token_id")
            and config["vocabulary_size"] <= GPT2_DEFAULT_TOKEN):
        # Unknown, and transformers' default (50256) is not a token of this vocabulary.
        generated.update(bos_token_id=None, eos_token_id=None)
    if "num_classes" in config:
        generated.update(exported_config.labels(config["num_classes"], label_names, source))
    elif label_names is not None:
        raise ValueError("label_names is for a classifier (BertClassifier); this model has "
                         "no classification head.")
    hf_config = exported_config.merged(generated, source, family.backbone_config)
    hf_config.update(torch_dtype=dtype)
    return hf_config


def _write_file(path: Path, keys, groups, shapes, dtype: str, writer: bool) -> None:
    target = _numpy(dtype)
    tmp = path.with_name(path.name + ".tmp")
    out = open(tmp, "wb") if writer else None
    try:
        if out:
            out.write(_header(keys, shapes, dtype, {"format": "pt"}))
        for key in keys:  # one HF tensor on the host at a time
            parts = [(tensor_map, _gather(variable.value if layer is None else
                                          variable.value[layer]))  # one layer of a stack
                     for tensor_map, variable, layer in groups[key]]
            values = np.ascontiguousarray(assemble(parts).astype(target))
            del parts
            if out:
                values.tofile(out)
        if out:
            out.flush()
            os.fsync(out.fileno())
    finally:
        if out:
            out.close()
    if writer:
        os.replace(tmp, path)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
