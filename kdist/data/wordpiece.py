"""WordPiece tokenizers for BERT: keras-hub's ``WordPieceTokenizer``, trained when needed.

The vocabulary is learned with the HF ``tokenizers`` WordPiece trainer, configured like
keras-hub's tokenizer (split on whitespace and punctuation, case and accents kept, ``##``
continuation prefix), and loaded into ``keras_hub.tokenizers.WordPieceTokenizer``, which
does all encoding in kdist (both packages are the ``text`` extra, imported when first
used): both give the same ids on the corpus (``tests/data/test_mlm.py`` checks it).
keras-hub's own trainer, ``keras_hub.tokenizers.compute_word_piece_vocabulary``, works
here too (it needs tensorflow-text, installed with keras-hub, and a ``tf.data`` dataset,
not a list) but took ~400 s on this corpus against ~3 s, so it is not the default.

Vocabularies are cached by corpus fingerprint and size in the directory
:func:`kdist.data.tokenizer.cache_root` names, as ``vocabulary.txt`` (one token per line,
the format BERT checkpoints use), so the second run does not train again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kdist._optional import optional_import
from kdist.data.tokenizer import cache_root

if TYPE_CHECKING:
    import keras_hub

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)  # ids 0..4 in this order


def train_word_piece(documents, vocabulary_size: int, path: Path) -> None:
    """Learns a WordPiece vocabulary of at most ``vocabulary_size`` entries into ``path``.

    The special tokens come first (``[PAD]`` = 0), then the learned tokens in sorted order, so
    the same documents always give the same file. Written atomically (temporary name, then
    rename), so concurrent runs never read a half-written file.
    """
    tokenizers = optional_import("tokenizers", "Training a WordPiece vocabulary")

    if vocabulary_size < 256:
        raise ValueError(
            f"vocabulary_size={vocabulary_size} is too small for a WordPiece vocabulary: it "
            f"needs the special tokens and the corpus's characters. Use at least 1024."
        )
    trainer = tokenizers.BertWordPieceTokenizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=False,
        wordpieces_prefix="##",
    )
    trainer.train_from_iterator(
        documents, vocab_size=vocabulary_size, min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS), show_progress=False, wordpieces_prefix="##",
    )
    # The trainer numbers the learned tokens in an order that differs from run to run (its
    # alphabet is a hash set), and token ids become embedding rows: sort them, so one corpus
    # gives one vocabulary.txt, ids and model in every process. WordPiece's longest-match
    # encoding does not depend on the order.
    learned = sorted(set(trainer.get_vocab()) - set(SPECIAL_TOKENS))
    vocabulary = [*SPECIAL_TOKENS, *learned]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text("\n".join(vocabulary) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def load_word_piece(path: str | os.PathLike) -> keras_hub.tokenizers.WordPieceTokenizer:
    """keras-hub's ``WordPieceTokenizer`` over a ``vocabulary.txt`` (one token per line).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "vocabulary.txt"
        >>> _ = p.write_text("\\n".join(list(SPECIAL_TOKENS) + ["def", "##s", "f"]))
        >>> load_word_piece(p).tokenize("defs f").tolist()
        [5, 6, 7]
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"WordPiece vocabulary {path} does not exist. Pass a vocabulary.txt "
                         f"(one token per line), or none to train one on the corpus.")
    vocabulary = [t for t in path.read_text(encoding="utf-8").splitlines() if t]
    missing = [t for t in SPECIAL_TOKENS if t not in vocabulary]
    if missing:
        raise ValueError(f"WordPiece vocabulary {path} lacks the special tokens {missing}; "
                         f"BERT needs {list(SPECIAL_TOKENS)}.")
    keras_hub = optional_import("keras_hub", "A WordPiece tokenizer")
    return keras_hub.tokenizers.WordPieceTokenizer(
        vocabulary=vocabulary, lowercase=False, strip_accents=False, oov_token=UNK,
    )


def word_piece_tokenizer(corpus, vocabulary_size: int = 8192,
                         cache_dir: Path | None = None, vocabulary: str | None = None):
    """A keras-hub ``WordPieceTokenizer`` for a corpus: ``vocabulary`` if given, else one
    trained on the corpus's training split once and then cached.

    Example:
        >>> from kdist.data.corpus import load_corpus
        >>> tok = word_piece_tokenizer(load_corpus(), vocabulary_size=8192)
        >>> tok.id_to_token(0), tok.detokenize(tok.tokenize("return x"))
        ('[PAD]', 'return x')
    """
    import jax

    optional_import("keras_hub", "A WordPiece tokenizer")  # missing: say so before training
    if vocabulary is not None:
        return load_word_piece(vocabulary)
    path = (cache_dir or cache_root()) / f"wordpiece-{corpus.fingerprint}-{vocabulary_size}" / (
        "vocabulary.txt")
    if jax.process_index() == 0 and not path.exists():
        print(f"Training a {vocabulary_size:,}-entry WordPiece vocabulary on the corpus (once; "
              f"cached in {path.parent})", flush=True)
        train_word_piece(corpus.train, vocabulary_size, path)
    if jax.process_count() > 1:
        _use_process_zeros_vocabulary(path)
    return load_word_piece(path)


def _use_process_zeros_vocabulary(path: Path) -> None:
    """Writes process 0's ``vocabulary.txt`` at ``path`` in every process.

    The HF trainer breaks ties between equally frequent merges in hash order, so two
    trainings of one corpus can keep different tokens; processes that trained on their own
    would give one word different ids. Process 0 trains (or reads its cache) and sends the
    file; the others write it atomically, replacing whatever their own cache held.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    text = path.read_bytes() if jax.process_index() == 0 else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(text))))
    buffer = np.zeros(size, np.uint8)
    if text:
        buffer[:] = np.frombuffer(text, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(buffer), np.uint8).tobytes()
    if jax.process_index() != 0 and (not path.exists() or path.read_bytes() != data):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

