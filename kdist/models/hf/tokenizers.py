"""Tokenizers of a Hugging Face model directory, as keras-hub tokenizer objects.

* Byte-pair (GPT-2, Llama 3): ``tokenizer.json``, or GPT-2's ``vocab.json`` + ``merges.txt``,
  into keras-hub's ``GPT2Tokenizer`` / ``Llama3Tokenizer`` / ``BytePairTokenizer``. keras-hub
  0.32 encodes (outside ``tf.data``) with a HF ``tokenizers`` backend it builds from the
  vocabulary and merges with *Llama 3's* split pattern — GPT-2's own pattern differs (it
  keeps digit runs whole, for one), so GPT-2 ids would differ. kdist gives the keras-hub
  object the model's exact pipeline instead: ``tokenizer.json`` as written, or for
  ``vocab.json`` + ``merges.txt`` the standard GPT-2 one (byte-level with GPT-2's regex,
  as ``transformers``' converter builds it). ``tests/models/test_hf_tokenizers.py``
  checks ids against ``tokenizers`` itself.
* WordPiece (BERT): ``vocab.txt`` (or ``tokenizer.json``'s vocabulary) into keras-hub's
  ``BertTokenizer``, lower-casing as ``tokenizer_config.json``'s ``do_lower_case`` says.

:func:`save_tokenizer` writes the same files back (export), so a directory kdist writes is
complete for ``from_pretrained`` and for ``transformers``. keras-hub and ``tokenizers`` are
the ``text`` extra, imported when first used (:mod:`kdist._optional`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kdist import _keras_compat
from kdist._optional import optional_import

TOKENIZER_JSON, VOCAB_JSON, MERGES, VOCAB_TXT = ("tokenizer.json", "vocab.json", "merges.txt",
                                                 "vocab.txt")
TOKENIZER_CONFIG = "tokenizer_config.json"
GPT2_END = "<|endoftext|>"
BERT_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"Cannot read {path}: {e}") from None


def _token(value) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def load_tokenizer(directory: str | os.PathLike):
    """The tokenizer of a Hugging Face model directory, as a keras-hub tokenizer.

    Example:
        >>> tok = load_tokenizer("path/to/gpt2")             # doctest: +SKIP
        >>> tok.tokenize("Hello world")                       # doctest: +SKIP
        array([15496,   995], dtype=int32)
    """
    directory = Path(directory).expanduser()
    settings = _json(directory / TOKENIZER_CONFIG) if (directory / TOKENIZER_CONFIG).exists() \
        else {}
    model_type = (_json(directory / "config.json").get("model_type")
                  if (directory / "config.json").exists() else None)
    if (directory / TOKENIZER_JSON).exists():
        spec = _json(directory / TOKENIZER_JSON)
        kind = (spec.get("model") or {}).get("type")
        if kind == "BPE":
            return _byte_pair_from_json(directory / TOKENIZER_JSON, spec, settings, model_type)
        if kind == "WordPiece" and not (directory / VOCAB_TXT).exists():
            vocab = spec["model"]["vocab"]
            return _word_piece(sorted(vocab, key=vocab.get), settings, spec)
        if kind not in ("WordPiece",):
            raise ValueError(f"{directory / TOKENIZER_JSON} holds a {kind!r} tokenizer; kdist "
                             f"loads byte-pair (BPE: GPT-2, Llama 3) and WordPiece (BERT).")
    if (directory / VOCAB_JSON).exists() and (directory / MERGES).exists():
        return _byte_pair_from_files(directory, settings, model_type)
    if (directory / VOCAB_TXT).exists():
        vocabulary = (directory / VOCAB_TXT).read_text(encoding="utf-8").splitlines()
        return _word_piece(vocabulary, settings)
    raise ValueError(f"{directory} has no tokenizer files: expected {TOKENIZER_JSON} (GPT-2, "
                     f"Llama 3), {VOCAB_JSON} + {MERGES} (GPT-2) or {VOCAB_TXT} (BERT).")


def _keras_hub():
    return optional_import("keras_hub", "A Hugging Face model's tokenizer")


def _tokenizers():
    return optional_import("tokenizers", "A Hugging Face model's tokenizer")


def _byte_pair(vocabulary: dict, merges: list[str], settings: dict, model_type, specials):
    """keras-hub's class for the family, its special tokens unsplittable."""
    keras_hub = _keras_hub()
    if model_type == "llama":
        bos = _token(settings.get("bos_token")) or "<|begin_of_text|>"
        eos = _token(settings.get("eos_token")) or "<|end_of_text|>"
        misc = {t for t in specials if not t.startswith("<|reserved_special_token_")}
        return keras_hub.tokenizers.Llama3Tokenizer(
            vocabulary=vocabulary, merges=merges, bos_token=bos, eos_token=eos,
            misc_special_tokens=misc - {bos, eos})
    if model_type == "gpt2" and GPT2_END in vocabulary:
        return keras_hub.tokenizers.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    return keras_hub.tokenizers.BytePairTokenizer(
        vocabulary=vocabulary, merges=merges, unsplittable_tokens=sorted(specials) or None)


def _byte_pair_from_json(path: Path, spec: dict, settings: dict, model_type):
    tokenizers = _tokenizers()
    vocabulary = dict(spec["model"]["vocab"])
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocabulary.update(added)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    specials = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    tokenizer = _byte_pair(vocabulary, merges, settings, model_type, specials)
    _keras_compat.set_byte_pair_backend(tokenizer, tokenizers.Tokenizer.from_file(str(path)))
    return tokenizer


def gpt2_backend(vocabulary: dict, merges: list[str], specials):
    """GPT-2's tokenization pipeline in HF ``tokenizers`` (what ``transformers`` converts
    ``vocab.json`` + ``merges.txt`` to): byte-level with GPT-2's regex."""
    hf = _tokenizers()
    Tokenizer, decoders, models, pre_tokenizers, processors = (
        hf.Tokenizer, hf.decoders, hf.models, hf.pre_tokenizers, hf.processors)
    pairs = [tuple(m.split(" ")) for m in merges if m and not m.startswith("#version")]
    backend = Tokenizer(models.BPE(vocab=vocabulary, merges=pairs, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    if specials:
        backend.add_special_tokens(sorted(specials))
    return backend


def _byte_pair_from_files(directory: Path, settings: dict, model_type):
    vocabulary = _json(directory / VOCAB_JSON)
    merges = [m for m in (directory / MERGES).read_text(encoding="utf-8").splitlines()
              if m and not m.startswith("#version")]
    specials = {GPT2_END} & set(vocabulary)
    tokenizer = _byte_pair(vocabulary, merges, settings, model_type or "gpt2", specials)
    _keras_compat.set_byte_pair_backend(tokenizer, gpt2_backend(vocabulary, merges, specials))
    return tokenizer


def _word_piece(vocabulary: list[str], settings: dict, spec: dict | None = None):
    lowercase = settings.get("do_lower_case")
    if lowercase is None and spec is not None:
        lowercase = (spec.get("normalizer") or {}).get("lowercase")
    lowercase = True if lowercase is None else bool(lowercase)  # HF BertTokenizer's default
    strip = settings.get("strip_accents")
    strip = lowercase if strip is None else bool(strip)
    missing = [t for t in BERT_SPECIAL if t not in vocabulary]
    keras_hub = _keras_hub()
    if missing:  # not a BERT vocabulary: plain WordPiece
        return keras_hub.tokenizers.WordPieceTokenizer(
            vocabulary=vocabulary, lowercase=lowercase, strip_accents=strip)
    return keras_hub.tokenizers.BertTokenizer(vocabulary=vocabulary, lowercase=lowercase,
                                              strip_accents=strip)


def save_tokenizer(tokenizer, directory: str | os.PathLike, max_length: int) -> list[str]:
    """Writes a keras-hub byte-pair or WordPiece tokenizer as Hugging Face files; returns
    their names.

    Byte-pair: ``vocab.json``, ``merges.txt`` and a ``tokenizer.json`` that records the
    exact pipeline the tokenizer encodes with (kdist's own vocabularies split like Llama 3,
    not like GPT-2, so ``vocab.json`` + ``merges.txt`` alone would tokenize differently:
    ``transformers``' ``GPT2Tokenizer`` rebuilds GPT-2's pipeline from them and splits
    ``".\\n\\n"`` into three tokens where kdist has one). ``tokenizer_config.json`` therefore
    names ``PreTrainedTokenizerFast``, which reads ``tokenizer.json`` as it is. WordPiece:
    ``vocab.txt``. Both with ``tokenizer_config.json`` and the special tokens.

    Example:
        >>> save_tokenizer(tokenizer, "out/", max_length=256)   # doctest: +SKIP
        ['vocab.json', 'merges.txt', 'tokenizer.json', 'tokenizer_config.json']
    """
    from kdist.models.hf.exported_config import special_tokens

    keras_hub, hf_tokenizers = _keras_hub(), _tokenizers()

    directory = Path(directory)
    tokens = special_tokens(tokenizer)
    if isinstance(tokenizer, keras_hub.tokenizers.BytePairTokenizer):
        vocabulary = dict(tokenizer.vocabulary)
        merges = [m for m in tokenizer.merges if not m.startswith("#version")]
        (directory / VOCAB_JSON).write_text(json.dumps(vocabulary, ensure_ascii=False),
                                            encoding="utf-8")
        (directory / MERGES).write_text("#version: 0.2\n" + "\n".join(merges) + "\n",
                                        encoding="utf-8")
        backend = _keras_compat.byte_pair_backend(tokenizer)  # what it encodes with
        names = [VOCAB_JSON, MERGES]
        if isinstance(backend, hf_tokenizers.Tokenizer):
            backend.save(str(directory / TOKENIZER_JSON))
            names.append(TOKENIZER_JSON)
        llama = isinstance(tokenizer, keras_hub.tokenizers.Llama3Tokenizer)
        exact = TOKENIZER_JSON in names  # else GPT-2's own pipeline, from the two files
        config = {"tokenizer_class": "PreTrainedTokenizerFast" if exact else "GPT2Tokenizer",
                  "model_max_length": max_length, "add_prefix_space": False,
                  "bos_token": tokens["bos"], "eos_token": tokens["eos"],
                  **({} if llama else {"unk_token": tokens["unk"]})}
    elif isinstance(tokenizer, keras_hub.tokenizers.WordPieceTokenizer):
        (directory / VOCAB_TXT).write_text("\n".join(tokenizer.get_vocabulary()) + "\n",
                                           encoding="utf-8")
        config = {"tokenizer_class": "BertTokenizer", "model_max_length": max_length,
                  "do_lower_case": bool(tokenizer.lowercase),
                  "strip_accents": bool(tokenizer.strip_accents),
                  **{f"{k}_token": t for k, t in (("pad", "[PAD]"), ("unk", "[UNK]"),
                                                  ("cls", "[CLS]"), ("sep", "[SEP]"),
                                                  ("mask", "[MASK]"))
                     if t in tokenizer.get_vocabulary()}}
        names = [VOCAB_TXT]
    else:
        raise TypeError(f"Cannot write a {type(tokenizer).__name__} as Hugging Face files; "
                        f"kdist writes keras-hub BytePairTokenizer and WordPieceTokenizer.")
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")
    return names + [TOKENIZER_CONFIG]
