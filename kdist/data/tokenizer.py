"""Byte-pair tokenizers: keras-hub's ``BytePairTokenizer``, trained on the corpus when needed.

keras-hub has no byte-pair trainer, so the merges are learned with the HF ``tokenizers``
package using exactly the pre-tokenization keras-hub applies (its GPT-2 split pattern, then
byte-level), and the result is loaded into ``keras_hub.tokenizers.BytePairTokenizer``,
which is what encodes and decodes everywhere in kdist. Trained vocabularies are cached by
corpus fingerprint and size, so the second run does not train again. Both packages are the
``text`` extra (``pip install 'kdist[text]'``), imported here when first used
(:mod:`kdist._optional`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kdist import _keras_compat
from kdist._optional import optional_import

if TYPE_CHECKING:
    import keras_hub

END_OF_TEXT = "<|endoftext|>"


def cache_root() -> Path:
    """Where kdist caches tokenizers and token stores: ``$KDIST_CACHE`` or ``~/.cache/kdist``."""
    root = os.environ.get("KDIST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kdist"
    )
    return Path(root)


def train_byte_pair(documents, vocabulary_size: int, directory: Path) -> None:
    """Learns a byte-level BPE vocabulary of ``vocabulary_size`` entries into ``directory``.

    Writes ``vocabulary.json`` and ``merges.txt`` atomically (temporary names, then rename).
    """
    tokenizers = optional_import("tokenizers", "Training a byte-pair vocabulary")
    models, pre_tokenizers, trainers = (tokenizers.models, tokenizers.pre_tokenizers,
                                        tokenizers.trainers)

    if vocabulary_size < 257 + 1:
        raise ValueError(
            f"vocabulary_size={vocabulary_size} is too small for a byte-level BPE: it needs "
            f"the 256 byte symbols plus {END_OF_TEXT!r}. Use at least 512."
        )
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                pattern=tokenizers.Regex(_keras_compat.byte_pair_split_pattern()),
                behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocabulary_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    state = json.loads(tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("vocabulary.json", json.dumps(state["vocab"], ensure_ascii=False)),
        ("merges.txt", "\n".join(merges) + "\n"),
    ):
        tmp = directory / f"{name}.tmp{os.getpid()}"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, directory / name)


def load_byte_pair(directory: Path) -> keras_hub.tokenizers.BytePairTokenizer:
    """Loads a vocabulary written by :func:`train_byte_pair` into keras-hub's tokenizer."""
    vocabulary = json.loads((directory / "vocabulary.json").read_text(encoding="utf-8"))
    merges = (directory / "merges.txt").read_text(encoding="utf-8").splitlines()
    keras_hub = optional_import("keras_hub", "A byte-pair tokenizer")
    return keras_hub.tokenizers.BytePairTokenizer(
        vocabulary=vocabulary, merges=[m for m in merges if m], unsplittable_tokens=[END_OF_TEXT]
    )


class BytePairVocabulary:
    """A byte-pair vocabulary on disk (``vocabulary.json`` and ``merges.txt``, as
    :func:`train_byte_pair` writes them), and keras-hub's tokenizer of it, built on first use.

    What needs only the vocabulary (its size, a token's id, the list of tokens) reads the
    JSON file; anything else (``tokenize``, ``detokenize``, ``save_assets``...) is the
    tokenizer's, which :meth:`load` builds once. So a process whose token stores are cached
    never imports keras-hub, nor the TensorFlow it brings (~3 CPU-s at every start-up: each
    rank of a job, each replica group).

    Example:
        >>> from kdist.data.corpus import load_corpus
        >>> vocab = byte_pair_vocabulary(load_corpus(), vocabulary_size=8192)
        >>> vocab.vocabulary_size(), vocab.token_to_id(END_OF_TEXT)  # no keras-hub yet
        (8192, 0)
        >>> vocab.detokenize(vocab.tokenize("def f(x):")) == "def f(x):"  # now loaded
        True
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._vocabulary = json.loads(
            (self.directory / "vocabulary.json").read_text(encoding="utf-8"))
        self._tokenizer = None

    def vocabulary_size(self) -> int:
        return len(self._vocabulary)

    def get_vocabulary(self) -> list[str]:
        """The tokens in id order: keras-hub's ``get_vocabulary()`` (the JSON's order)."""
        return list(self._vocabulary)

    def token_to_id(self, token: str) -> int:
        return self._vocabulary[token]

    def load(self) -> keras_hub.tokenizers.BytePairTokenizer:
        """keras-hub's tokenizer of this vocabulary (built once)."""
        if self._tokenizer is None:
            self._tokenizer = load_byte_pair(self.directory)
        return self._tokenizer

    def __getattr__(self, name: str):  # only for what the class does not define
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.load(), name)


def byte_pair_vocabulary(corpus, vocabulary_size: int,
                         cache_dir: Path | None = None) -> BytePairVocabulary:
    """:func:`byte_pair_tokenizer`'s vocabulary, trained once and then cached, with keras-hub's
    tokenizer built only when first used (:class:`BytePairVocabulary`). keras-hub is
    required (and imported) before training, as a vocabulary is of no use without it."""
    directory = (cache_dir or cache_root()) / f"bpe-{corpus.fingerprint}-{vocabulary_size}"
    if not (directory / "merges.txt").exists():
        optional_import("keras_hub", "A byte-pair tokenizer")  # missing: say so before training
        print(f"Training a {vocabulary_size:,}-entry byte-pair vocabulary on the corpus (once; "
              f"cached in {directory})", flush=True)
        train_byte_pair(corpus.train, vocabulary_size, directory)
    return BytePairVocabulary(directory)


def byte_pair_tokenizer(corpus, vocabulary_size: int, cache_dir: Path | None = None):
    """A keras-hub ``BytePairTokenizer`` for a corpus, trained once and then cached.

    Example:
        >>> from kdist.data.corpus import load_corpus
        >>> tok = byte_pair_tokenizer(load_corpus(), vocabulary_size=8192)
        >>> tok.detokenize(tok.tokenize("def f(x):\\n    return x")) == "def f(x):\\n    return x"
        True
    """
    optional_import("keras_hub", "A byte-pair tokenizer")  # missing: say so before training
    return byte_pair_vocabulary(corpus, vocabulary_size, cache_dir).load()
