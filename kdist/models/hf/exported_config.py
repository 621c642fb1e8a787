"""The ``config.json`` and ``generation_config.json`` an export writes, faithful to what the
model computes and to where it came from.

* A model loaded with ``from_pretrained`` remembers its source ``config.json``
  (:func:`remember_source`). Its export keeps every source field the family's mapping writes
  the same way in kdist's terms (``n_inner: null`` stays null rather than becoming
  ``4 x n_embd``, ``gelu_fast`` stays ``gelu_fast``) and every field kdist does not read
  (``attn_pdrop``, ``bos_token_id``...), so load -> export round-trips them; a field kdist
  computes differently (a ``dropout=`` override) is written as kdist computes it.
* The special tokens' ids come from the tokenizer exported beside the weights (GPT-2's
  default 50256 would lie outside a kdist vocabulary of 2,048); a causal LM also gets a
  ``generation_config.json`` with them, which ``transformers``' ``generate`` reads.
* A classifier's ``id2label`` / ``label2id`` carry ``label_names`` when given (else the
  source's, else ``LABEL_i``).

Example:
    >>> merged({"n_inner": 256, "attn_pdrop": 0.0}, {"n_inner": None, "attn_pdrop": 0.1},
    ...        lambda c: {"intermediate": c["n_inner"] or 256})
    {'n_inner': None, 'attn_pdrop': 0.1}
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

# Fields an export decides by itself: the stored dtype, the class transformers builds, the
# task head's labels, the tokenizer's ids.
_DECIDED = ("torch_dtype", "dtype", "architectures", "num_labels", "id2label", "label2id",
            "transformers_version")
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_source(model, config: dict) -> None:
    """Records the ``config.json`` ``model`` (a task or backbone) was loaded from."""
    for obj in {id(model): model, id(getattr(model, "backbone", model)): getattr(
            model, "backbone", model)}.values():
        _SOURCES[obj] = dict(config)


def source_config(model) -> dict | None:
    """The ``config.json`` ``model`` (or its backbone) was loaded from, if any."""
    return _SOURCES.get(model) or _SOURCES.get(getattr(model, "backbone", None) or model)


def merged(generated: dict, source: dict | None, read: Callable[[dict], dict]) -> dict:
    """``generated`` with the source's fields put back wherever that changes nothing kdist
    reads (``read``: the family's ``backbone_config``). Fields the export decides itself
    (dtype, architectures, labels, token ids) stay generated."""
    if not source:
        return generated
    out = dict(generated)
    for key, value in source.items():
        if key in _DECIDED or key in _TOKEN_FIELDS and key in generated:
            continue
        if key not in out:
            out[key] = value
        elif out[key] != value and _reads_alike(read, {**out, key: value}, out):
            out[key] = value
    return out


def _reads_alike(read, a: dict, b: dict) -> bool:
    try:
        return read(a) == read(b)
    except (KeyError, ValueError, TypeError):
        return False


def special_tokens(tokenizer) -> dict[str, str | None]:
    """``{"bos", "eos", "pad", "unk"}`` token strings of a keras-hub tokenizer: its own
    attributes where it has them (GPT-2, Llama 3, BERT tokenizers), else kdist's
    conventions (``<|endoftext|>`` for byte-pair, ``[PAD]``/``[UNK]`` for WordPiece)."""
    vocabulary = set(_vocabulary(tokenizer))
    end = "<|endoftext|>" if "<|endoftext|>" in vocabulary else None
    bos = getattr(tokenizer, "start_token", None) or end
    eos = getattr(tokenizer, "end_token", None) or end
    pad = getattr(tokenizer, "pad_token", None) or ("[PAD]" if "[PAD]" in vocabulary else None)
    unk = "[UNK]" if "[UNK]" in vocabulary else end
    return {k: v if isinstance(v, str) and v in vocabulary else None
            for k, v in dict(bos=bos, eos=eos, pad=pad, unk=unk).items()}


def token_ids(tokenizer) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of the tokenizer's special
    tokens (those it has)."""
    if tokenizer is None:
        return {}
    tokens = special_tokens(tokenizer)
    return {f"{k}_token_id": int(tokenizer.token_to_id(tokens[k])) for k in ("bos", "eos", "pad")
            if tokens[k] is not None}


def _vocabulary(tokenizer) -> Sequence[str]:
    vocabulary = getattr(tokenizer, "vocabulary", None)
    return list(vocabulary) if isinstance(vocabulary, dict) else list(
        tokenizer.get_vocabulary())


def labels(num_classes: int, label_names: Sequence[str] | None, source: dict | None) -> dict:
    """``num_labels``, ``id2label`` and ``label2id`` of a classifier's head."""
    if label_names is not None:
        names = [str(n) for n in label_names]
        if len(names) != num_classes:
            raise ValueError(f"label_names has {len(names)} names but the classifier has "
                             f"{num_classes} classes; pass one name per class, in class order.")
    elif source and len(source.get("id2label") or {}) == num_classes:
        names = [source["id2label"][str(i)] for i in range(num_classes)]
    else:
        names = [f"LABEL_{i}" for i in range(num_classes)]
    return {"num_labels": num_classes, "id2label": {str(i): n for i, n in enumerate(names)},
            "label2id": {n: i for i, n in enumerate(names)}}


def generation_config(config: dict) -> dict:
    """The ``generation_config.json`` of a causal LM's ``config.json``: its token ids."""
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if config.get(k) is not None}
