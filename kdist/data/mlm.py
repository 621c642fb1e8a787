"""Masked-language-model batches for BERT: segment packing, then dynamic masking per step.

**Packing** (once per corpus, tokenizer and length; cached): each document's non-empty
lines are WordPiece-tokenized and consecutive lines are packed into sequences of at most
``sequence_length - 3`` tokens (a longer line is cut). Each sequence is split at the line
boundary nearest its middle into segment A and segment B and laid out BERT's way::

    [CLS] A ... [SEP] B ... [SEP] [PAD] ...      segment ids 0 ... 0 1 ... 1 0 ...

(B is the text that follows A: there is no next-sentence task, as in RoBERTa.)

**Masking** (every step anew, "dynamic masking"): keras-hub's ``MaskedLMMaskGenerator``
selects each real token (not ``[CLS]``, ``[SEP]``, ``[PAD]``) with probability 0.15, at
most ``mask_selection_length`` per sequence, and replaces a selected token by ``[MASK]``
80% of the time, a random token 10%, and keeps it 10%. The generator draws from Python's
global ``random``; kdist seeds it from ``(seed, split, step, process)`` under a lock, so a
batch is a pure function of those, like :class:`kdist.data.LMBatches`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import random
import threading
from pathlib import Path

import keras
import numpy as np

from kdist._optional import optional_import
from kdist.data.checks import check_token_ids
from kdist.data.corpus import STDLIB, load_corpus
from kdist.data.sampling import StepSampler
from kdist.data.tokenizer import cache_root
from kdist.data.wordpiece import CLS, MASK, PAD, SEP, word_piece_tokenizer
from kdist.parallel.layout import replica_count


def pack_segments(documents, tokenizer, sequence_length: int,
                  progress=None) -> dict[str, np.ndarray]:
    """Packs documents' lines into ``[CLS] A [SEP] B [SEP]`` rows (see the module docstring).
    ``progress(n)`` (e.g. a ``keras.utils.Progbar``'s ``update``) is told every document.

    Returns ``token_ids`` ``(N, T)``, ``segment_ids`` ``(N, T)`` (uint8) and ``lengths``
    ``(N,)`` (real tokens per row; the rest is ``[PAD]``).

    Example:
        >>> from kdist.data.wordpiece import load_word_piece, SPECIAL_TOKENS
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "vocabulary.txt"
        >>> _ = p.write_text("\\n".join(list(SPECIAL_TOKENS) + ["a", "b", "c"]))
        >>> packed = pack_segments(["a b\\nc\\n"], load_word_piece(p), sequence_length=8)
        >>> packed["token_ids"].tolist(), packed["segment_ids"].tolist()
        ([[2, 5, 6, 3, 7, 3, 0, 0]], [[0, 0, 0, 0, 1, 1, 0, 0]])
    """
    if sequence_length < 8:
        raise ValueError(f"sequence_length must be at least 8 for [CLS] A [SEP] B [SEP]; got "
                         f"{sequence_length}.")
    cls_id, sep_id = tokenizer.token_to_id(CLS), tokenizer.token_to_id(SEP)
    budget = sequence_length - 3
    rows, segments = [], []

    def emit(chunk):
        if len(chunk) == 1:  # one line: split its tokens in the middle
            half = (len(chunk[0]) + 1) // 2
            a, b = chunk[0][:half], chunk[0][half:]
        else:  # split at the line boundary nearest the middle
            ends = np.cumsum([len(line) for line in chunk])  # tokens up to each line's end
            k = 1 + int(np.argmin(np.abs(ends[:-1] - ends[-1] / 2)))  # 1 <= k < len(chunk)
            a, b = np.concatenate(chunk[:k]), np.concatenate(chunk[k:])
        row = [cls_id, *a.tolist(), sep_id] + ([*b.tolist(), sep_id] if len(b) else [])
        rows.append(row)
        segments.append([0] * (len(a) + 2) + [1] * (len(row) - len(a) - 2))

    for done, document in enumerate(documents, 1):
        if progress is not None:
            progress(done)
        lines = [line for line in document.splitlines() if line.strip()]
        if not lines:
            continue
        chunk, used = [], 0
        for ids in tokenizer.tokenize(lines):
            ids = np.asarray(ids, dtype=np.int64)[:budget]
            if not len(ids):
                continue
            if chunk and used + len(ids) > budget:
                emit(chunk)
                chunk, used = [], 0
            chunk.append(ids)
            used += len(ids)
        if chunk:
            emit(chunk)
    if not rows:
        raise ValueError("No text to pack: the documents have no non-empty lines.")
    dtype = np.uint16 if tokenizer.vocabulary_size() <= 2**16 else np.uint32
    token_ids = np.full((len(rows), sequence_length), tokenizer.token_to_id(PAD), dtype)
    segment_ids = np.zeros((len(rows), sequence_length), np.uint8)
    for i, (row, seg) in enumerate(zip(rows, segments)):
        token_ids[i, : len(row)] = row
        segment_ids[i, : len(seg)] = seg
    lengths = np.asarray([len(r) for r in rows], np.int32)
    return {"token_ids": token_ids, "segment_ids": segment_ids, "lengths": lengths}


def packed_store(documents, tokenizer, sequence_length: int, path: Path) -> dict[str, np.ndarray]:
    """:func:`pack_segments`, computed once into ``path`` (``.npz``) and loaded after; the
    first time (minutes for the embedded corpus on 2 cores) says so and shows progress."""
    if not path.exists():
        print(f"Packing {len(documents):,} documents into {path.name} (once; later runs "
              f"reuse it)", flush=True)
        bar = keras.utils.Progbar(len(documents), unit_name="document")
        packed = pack_segments(documents, tokenizer, sequence_length, progress=bar.update)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npz")
        np.savez(tmp, **packed)
        os.replace(tmp, path)
    with np.load(path) as stored:
        return {k: stored[k] for k in stored.files}


def default_mask_selection_length(sequence_length: int, rate: float) -> int:
    """Masked slots per sequence: the expected count plus 3 standard deviations, so the cap
    rarely binds (BERT used 20 for 128 tokens at 15%; this gives 32)."""
    mean = sequence_length * rate
    return math.ceil(mean + 3 * math.sqrt(mean * (1 - rate)))


_RANDOM_LOCK = threading.Lock()  # the mask generator draws from Python's global `random`


class MLMBatches(keras.utils.PyDataset):
    """Masked-LM batches ``(inputs, mask_ids, mask_weights)`` from packed rows.

    ``inputs`` holds ``token_ids`` (masked), ``segment_ids``, ``padding_mask`` (each
    ``(local_batch, T)`` int32) and ``mask_positions`` ``(local_batch, P)``; ``mask_ids``
    are the original tokens there and ``mask_weights`` are 1 at real selections, 0 at
    unused slots — the labels and sample weights of :class:`kdist.models.BertMaskedLM`.

    Args:
        packed: :func:`pack_segments`' arrays (a cached copy is fine).
        global_batch_size: sequences per step over all processes.
        vocabulary_size, mask_token_id, unselectable_token_ids: for the mask generator.
        mask_selection_rate, mask_token_rate, random_token_rate: BERT's 0.15, 0.8, 0.1.
        mask_selection_length: masked slots P per sequence (default: see
            :func:`default_mask_selection_length`).
        seed, shuffle, start_step, num_steps, process_index, process_count: as for
            :class:`kdist.data.LMBatches`; the masks depend on ``seed`` and the step too.
        split: a number mixed into the mask seed, so validation masks differ from training's.
        spread: with ``shuffle=False`` and ``num_steps`` covering fewer rows than there are,
            the rows are evenly strided over all of them (a representative validation
            sample), not the first ``num_steps * global_batch_size``.

    Example:
        >>> packed = {"token_ids": np.full((10, 16), 7), "segment_ids": np.zeros((10, 16)),
        ...           "lengths": np.full(10, 16)}
        >>> ds = MLMBatches(packed, 4, vocabulary_size=100, mask_token_id=4,
        ...                 unselectable_token_ids=[0, 2, 3])
        >>> x, y, w = ds[0]
        >>> x["mask_positions"].shape == y.shape == w.shape == (4, 7)
        True
    """

    def __init__(
        self,
        packed: dict[str, np.ndarray],
        global_batch_size: int,
        vocabulary_size: int,
        mask_token_id: int,
        unselectable_token_ids,
        mask_selection_rate: float = 0.15,
        mask_selection_length: int | None = None,
        mask_token_rate: float = 0.8,
        random_token_rate: float = 0.1,
        seed: int = 0,
        shuffle: bool = True,
        start_step: int = 0,
        num_steps: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
        split: int = 0,
        spread: bool = False,
    ):
        super().__init__()
        keras_hub = optional_import("keras_hub", "Masked-LM batches (MaskedLMMaskGenerator)")

        if not 0 < mask_selection_rate < 1:
            raise ValueError(f"mask_selection_rate must be in (0, 1); got {mask_selection_rate}.")
        self.packed = packed
        self.sequence_length = packed["token_ids"].shape[1]
        self.global_batch_size = global_batch_size
        self.start_step = start_step
        self.num_steps = num_steps
        self.seed = seed
        self.split = split
        self.process_index = process_index
        self.sampler = StepSampler(
            len(packed["token_ids"]), global_batch_size, seed, shuffle, process_index,
            process_count,
            spread=num_steps * global_batch_size if spread and num_steps is not None else None)
        self.mask_selection_length = mask_selection_length or default_mask_selection_length(
            self.sequence_length, mask_selection_rate)
        self.masker = keras_hub.layers.MaskedLMMaskGenerator(
            vocabulary_size=vocabulary_size,
            mask_selection_rate=mask_selection_rate,
            mask_selection_length=self.mask_selection_length,
            mask_token_id=mask_token_id,
            unselectable_token_ids=list(unselectable_token_ids),
            mask_token_rate=mask_token_rate,
            random_token_rate=random_token_rate,
        )
        self._positions = np.arange(self.sequence_length)

    @property
    def num_batches(self):
        return self.num_steps

    def __len__(self):
        if self.num_steps is None:
            raise TypeError("An endless MLMBatches has no len(); use steps_per_epoch.")
        return self.num_steps

    def mask(self, token_ids: np.ndarray, step: int) -> dict[str, np.ndarray]:
        """The mask generator's output for ``token_ids``, seeded by (seed, split, step, process)."""
        seed = np.random.SeedSequence(
            [self.seed, self.split, step, self.process_index]).generate_state(1)[0]
        with _RANDOM_LOCK:
            state = random.getstate()
            random.seed(int(seed))
            try:
                out = self.masker(token_ids)
            finally:
                random.setstate(state)
        return {k: np.asarray(v) for k, v in out.items()}

    def __getitem__(self, index: int):
        if self.num_steps is not None and not 0 <= index < self.num_steps:
            raise IndexError(f"Batch {index} is out of range for {self.num_steps} batches.")
        step = self.start_step + index
        rows = self.sampler.rows(step)
        token_ids = self.packed["token_ids"][rows].astype(np.int32)
        masked = self.mask(token_ids, step)
        inputs = {
            "token_ids": masked["token_ids"].astype(np.int32),
            "segment_ids": self.packed["segment_ids"][rows].astype(np.int32),
            "padding_mask": (self._positions < self.packed["lengths"][rows, None]).astype(
                np.int32),
            "mask_positions": masked["mask_positions"].astype(np.int32),
        }
        return (inputs, masked["mask_ids"].astype(np.int32),
                masked["mask_weights"].astype(np.float32))


@dataclasses.dataclass
class MLMData:
    """What :func:`mlm_dataset` returns: datasets plus what a script needs to know."""

    train: MLMBatches
    validation: MLMBatches
    tokenizer: object
    vocabulary_size: int
    train_sequences: int
    validation_sequences: int
    mask_selection_length: int
    validation_coverage: str = ""  # what the validation batches cover, for a log line


def mlm_dataset(
    source: str = STDLIB,
    sequence_length: int = 128,
    global_batch_size: int = 32,
    vocabulary_size: int = 8192,
    vocabulary: str | None = None,
    seed: int = 0,
    start_step: int = 0,
    validation_steps: int | None = None,
    mask_selection_rate: float = 0.15,
    cache_dir: str | os.PathLike | None = None,
    encoding: str = "utf-8",
) -> MLMData:
    """Masked-LM data from a corpus: WordPiece tokenizer, packed rows, masked batches.

    The WordPiece vocabulary is ``vocabulary`` (a ``vocabulary.txt``) or trained on the
    training split and cached; packed rows are cached per (corpus, vocabulary, length).
    The global batch must divide by the replicas (``data * fsdp``) of the active mesh.
    Validation is the whole validation split by default; with ``validation_steps=N`` (fewer
    batches than it holds), N batches of rows evenly strided over all of it. Local text is
    decoded with ``encoding`` (see :func:`kdist.data.load_corpus`); packed token ids are
    checked against the vocabulary.

    Example:
        >>> data = mlm_dataset(sequence_length=64, global_batch_size=8)
        >>> x, y, w = data.train[0]
        >>> x["token_ids"].shape, y.shape == w.shape
        ((8, 64), True)
    """
    import jax

    for name, value in (("sequence_length", sequence_length),
                        ("global_batch_size", global_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}.")
    replicas = replica_count()
    if global_batch_size % replicas:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by the {replicas} model "
            f"replicas (data x fsdp) of the active mesh. Use a multiple of {replicas}."
        )
    if validation_steps is not None and (
            isinstance(validation_steps, bool) or not isinstance(validation_steps, int)
            or validation_steps < 1):
        raise ValueError(f"validation_steps must be a positive integer or None (the whole "
                         f"validation split); got {validation_steps!r}.")
    cache = Path(cache_dir) if cache_dir is not None else cache_root()
    corpus = load_corpus(source, encoding=encoding)
    tokenizer = word_piece_tokenizer(corpus, vocabulary_size, cache, vocabulary)
    vocab_key = hashlib.sha256("\n".join(tokenizer.get_vocabulary()).encode()).hexdigest()[:12]
    stores = {
        split: packed_store(
            getattr(corpus, split), tokenizer, sequence_length,
            cache / f"mlm-{corpus.fingerprint}-{vocab_key}-{sequence_length}-{split}.npz",
        )
        for split in ("train", "validation")
    }
    for split, store in stores.items():  # a cached store from another vocabulary, say
        check_token_ids(store["token_ids"], tokenizer.vocabulary_size(),
                        f"The packed {split} rows of {source!r}")
    common = dict(
        global_batch_size=global_batch_size,
        vocabulary_size=tokenizer.vocabulary_size(),
        mask_token_id=tokenizer.token_to_id(MASK),
        unselectable_token_ids=[tokenizer.token_to_id(t) for t in (PAD, CLS, SEP)],
        mask_selection_rate=mask_selection_rate,
        seed=seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    full_validation_steps = len(stores["validation"]["token_ids"]) // global_batch_size
    if full_validation_steps < 1:
        raise ValueError(
            f"The validation split has {len(stores['validation']['token_ids'])} sequences, "
            f"less than one global batch of {global_batch_size}. Use a smaller batch or a "
            f"larger corpus."
        )
    train = MLMBatches(stores["train"], start_step=start_step, split=0, **common)
    steps = min(validation_steps or full_validation_steps, full_validation_steps)
    validation = MLMBatches(stores["validation"], shuffle=False, split=1, num_steps=steps,
                            spread=True, **common)
    if steps == full_validation_steps:
        coverage = f"the whole validation split: {steps} batches in order"
    else:
        coverage = (f"{steps} of the validation split's {full_validation_steps} batches, rows "
                    f"evenly strided over the whole split")
    return MLMData(
        train=train,
        validation=validation,
        tokenizer=tokenizer,
        vocabulary_size=tokenizer.vocabulary_size(),
        train_sequences=len(stores["train"]["token_ids"]),
        validation_sequences=len(stores["validation"]["token_ids"]),
        mask_selection_length=train.mask_selection_length,
        validation_coverage=coverage,
    )
