"""Language-model batches: tokenize once into a token store, then pack and serve windows.

Documents are tokenized, each followed by the end-of-text id, and concatenated into one
token stream stored as a ``.npy`` file and memory-mapped. The stream is cut into
non-overlapping windows of ``sequence_length + 1`` tokens (inputs and shifted targets).

Batches are a pure function of ``(seed, step, process)``: global sample ``i`` of the run
is window ``permutation(seed, epoch)[i % num_windows]`` with ``epoch = i // num_windows``,
and step ``s`` holds samples ``s * global_batch_size ...``, of which process ``p`` takes
its contiguous share. So every window is used once per epoch, any step can be produced
directly (exact, cheap resume), and each process reads only its own rows.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import types
from functools import lru_cache
from pathlib import Path

import keras
import numpy as np

from kdist import _keras_compat
from kdist.data.checks import check_token_ids
from kdist.data.corpus import STDLIB
from kdist.data.sources import text_source
from kdist.data.token_store import exclusive, token_store
from kdist.data.tokenizer import (
    END_OF_TEXT,
    BytePairVocabulary,
    byte_pair_vocabulary,
    cache_root,
)
from kdist.parallel.layout import process_batch_share, replica_count

# Text used to train a byte-pair vocabulary when none is cached (the start of the training
# split): enough for a stable vocabulary, bounded for corpora of any size.
TOKENIZER_TRAINING_CHARACTERS = 64_000_000


class LMBatches(keras.utils.PyDataset):
    """Batches of ``(inputs, targets)``, each ``(local_batch, sequence_length)`` int32.

    Args:
        tokens: the token stream (any 1-D integer array; a memmap reads only what is used).
        sequence_length: tokens per example.
        global_batch_size: examples per step over all processes.
        seed: shuffling seed; ``shuffle=False`` serves windows in order (validation).
        start_step: index 0 of this dataset is this global step (for resuming).
        num_steps: length of the dataset; None means endless (training, with
            ``steps_per_epoch``).
        process_index, process_count: which share of each global batch this process reads.
        spread: with ``shuffle=False`` and ``num_steps`` covering fewer windows than the
            stream holds, sample ``i`` of the ``n = num_steps * global_batch_size`` is window
            ``i * num_windows // n``: evenly strided over the whole stream (a validation
            sample representative of all of it), instead of its first ``n`` windows.
        end_of_text_id: if set, inputs are ``{"token_ids", "segment_ids"}`` where segment
            ids count the documents (end-of-text tokens) before each position, for
            document-aware attention; the end-of-text token closes its own document.
        workers, max_queue_size: threads preparing batches ahead of the training step,
            and how many they may hold (Keras' ``PyDataset`` prefetching).
        vocabulary_size: if given, every id of ``tokens`` is checked to lie in
            ``[0, vocabulary_size)`` now (one pass; ``lm_dataset`` checks its stores already):
            an id past the vocabulary would give NaN logits and a loss of 0.0.

    Example:
        >>> ds = LMBatches(np.arange(1000), sequence_length=8, global_batch_size=4)
        >>> x, y = ds[0]
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        ((4, 8), True)
    """

    def __init__(
        self,
        tokens,
        sequence_length: int,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        start_step: int = 0,
        num_steps: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
        end_of_text_id: int | None = None,
        workers: int = 1,
        max_queue_size: int = 8,
        spread: bool = False,
        vocabulary_size: int | None = None,
    ):
        # workers > 1: Keras' PyDataset prepares batches ahead on threads, in order.
        super().__init__(workers=workers, max_queue_size=max_queue_size)
        if global_batch_size % process_count:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide by the "
                f"{process_count} processes. Use a multiple of {process_count}."
            )
        self.tokens = tokens
        self.sequence_length = sequence_length
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.start_step = start_step
        self.num_steps = num_steps
        self.process_index = process_index
        self.process_count = process_count
        self.end_of_text_id = end_of_text_id
        self.spread = spread
        self.num_windows = (len(tokens) - 1) // sequence_length
        if self.num_windows < 1:
            raise ValueError(
                f"The token stream has {len(tokens)} tokens, fewer than one window of "
                f"sequence_length + 1 = {sequence_length + 1}. Use more text or a shorter "
                f"sequence_length."
            )
        self._offsets = np.arange(sequence_length + 1)
        if vocabulary_size is not None:
            check_token_ids(tokens, vocabulary_size, "LMBatches' tokens")

    @property
    def num_batches(self):
        return self.num_steps

    def __len__(self):
        if self.num_steps is None:
            raise TypeError("An endless LMBatches has no len(); use steps_per_epoch.")
        return self.num_steps

    @lru_cache(maxsize=2)  # noqa: B019 (one dataset object per run; two epochs in flight)
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def windows(self, step: int) -> np.ndarray:
        """Window indices of this process's rows at a global step."""
        local = self.global_batch_size // self.process_count
        first = step * self.global_batch_size + self.process_index * local
        samples = np.arange(first, first + local)
        if not self.shuffle and self.spread and self.num_steps is not None:
            total = self.num_steps * self.global_batch_size
            if total < self.num_windows:
                return samples * self.num_windows // total  # evenly strided over the stream
        epochs, positions = np.divmod(samples, self.num_windows)
        if not self.shuffle:
            return positions
        return np.concatenate(
            [self._permutation(int(e))[positions[epochs == e]] for e in np.unique(epochs)]
        )

    def __getitem__(self, index: int):
        if self.num_steps is not None and not 0 <= index < self.num_steps:
            raise IndexError(f"Batch {index} is out of range for {self.num_steps} batches.")
        starts = self.windows(self.start_step + index) * self.sequence_length
        rows = np.asarray(self.tokens[starts[:, None] + self._offsets], dtype=np.int32)
        inputs, targets = rows[:, :-1], rows[:, 1:]
        if self.end_of_text_id is None:
            return inputs, targets
        ends = np.cumsum(inputs == self.end_of_text_id, axis=1, dtype=np.int32)
        segment_ids = np.pad(ends[:, :-1], ((0, 0), (1, 0)))  # documents ended before t
        return {"token_ids": inputs, "segment_ids": segment_ids}, targets


@dataclasses.dataclass
class LMData:
    """What :func:`lm_dataset` returns: datasets plus what a script needs to know.

    ``tokenizer`` is keras-hub's; the one :func:`lm_dataset` trained (or found cached) is
    built when first read, so a run on cached token stores that never reads it never
    imports keras-hub and TensorFlow (:class:`kdist.data.tokenizer.BytePairVocabulary`)."""

    train: LMBatches
    validation: LMBatches
    tokenizer: object = dataclasses.field(repr=False)
    vocabulary_size: int
    train_tokens: int
    validation_tokens: int
    validation_coverage: str = ""  # what the validation batches cover, for a log line


def _tokenizer(data: LMData):
    value = data.__dict__["tokenizer"]
    return value.load() if isinstance(value, BytePairVocabulary) else value


# The field read through a property (the dataclass's __init__ assigns through it too).
LMData.tokenizer = property(_tokenizer, lambda data, value: data.__dict__.update(tokenizer=value))


def lm_dataset(
    source: str = STDLIB,
    sequence_length: int = 256,
    global_batch_size: int = 32,
    vocabulary_size: int = 8192,
    seed: int = 0,
    start_step: int = 0,
    validation_steps: int | None = None,
    document_mask: bool = False,
    cache_dir: str | os.PathLike | None = None,
    tfds_data_dir: str | os.PathLike | None = None,
    tfds_manual_dir: str | os.PathLike | None = None,
    tfds_download: bool = False,
    prefetch: int = 2,
    verbose: bool = True,
    encoding: str = "utf-8",
    tokenizer=None,
    end_of_text: str = END_OF_TEXT,
) -> LMData:
    """Causal-LM data from a source: tokenizer, token store, train and validation batches.

    ``source`` is ``"python-stdlib"``, a local file/directory/glob or ``"tfds:NAME"`` (see
    :func:`kdist.data.sources.text_source`; the ``tfds_*`` arguments are for TFDS). The
    tokenizer is trained on the start of the training split when not cached yet; the token
    store is written once per (source, tokenizer), streaming. With ``document_mask=True``
    the inputs carry segment ids, for a model built with ``document_mask=True``. The global
    batch must divide by the number of replicas of the active distribution
    (``data * fsdp``); each process's datasets yield only its share of every global batch
    (:func:`kdist.parallel.layout.process_batch_share`). ``prefetch`` threads prepare training
    batches ahead of the step (Keras' ``PyDataset`` workers); 1 prepares them in line.

    Validation covers the whole validation split, in order, by default; with
    ``validation_steps=N`` (fewer batches than the split holds) it is a fixed sample of N
    batches whose windows are evenly strided over the whole split (``LMBatches(spread=True)``),
    not its first N batches. ``LMData.validation_coverage`` says which, in words.

    ``tokenizer``: a keras-hub tokenizer to encode with instead of training one (a
    pretrained model's, e.g. ``kdist.hf.load_tokenizer(DIR)``; ``vocabulary_size`` is then
    the tokenizer's); ``end_of_text``: the token appended after each document (Llama 3:
    ``"<|end_of_text|>"``).

    Local text files are decoded with ``encoding``; undecodable bytes are counted, warned
    about, and refused above 0.1% of a file (:func:`kdist.data.checks.decode_text`). Token
    ids are checked against the vocabulary when each token store is opened.

    Example:
        >>> data = lm_dataset("python-stdlib", sequence_length=128, global_batch_size=8)
        >>> x, y = data.train[0]
        >>> x.shape
        (8, 128)
    """

    for name, value in (("sequence_length", sequence_length),
                        ("global_batch_size", global_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}.")
    replicas = replica_count()
    if global_batch_size % replicas:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by the {replicas} model "
            f"replicas (data x fsdp) of the active mesh, so the batch cannot be split evenly. "
            f"Use a multiple of {replicas}, e.g. "
            f"{replicas * max(1, global_batch_size // replicas)}."
        )
    if not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be a positive integer (threads); got {prefetch!r}.")
    if validation_steps is not None and (
            isinstance(validation_steps, bool) or not isinstance(validation_steps, int)
            or validation_steps < 1):
        raise ValueError(f"validation_steps must be a positive integer or None (the whole "
                         f"validation split); got {validation_steps!r}.")
    cache = Path(cache_dir) if cache_dir is not None else cache_root()
    text = text_source(source, tfds_data_dir, tfds_manual_dir, tfds_download,
                       encoding=encoding)
    sample = types.SimpleNamespace(  # what byte_pair_vocabulary reads, streamed
        fingerprint=text.fingerprint, train=text.sample(TOKENIZER_TRAINING_CHARACTERS)
    )
    pipeline = ""  # a given tokenizer: its whole encoding pipeline keys its token stores
    if tokenizer is None:
        with exclusive(cache / f"bpe-{text.fingerprint}-{vocabulary_size}.lock"):
            tokenizer = byte_pair_vocabulary(sample, vocabulary_size, cache)  # loads lazily
    else:
        try:
            tokenizer.token_to_id(end_of_text)
        except (ValueError, KeyError):
            raise ValueError(f"end_of_text={end_of_text!r} is not a token of the given "
                             f"tokenizer; pass the token its model ends documents with (GPT-2: "
                             f"'<|endoftext|>', Llama 3: '<|end_of_text|>').") from None
        backend = _keras_compat.byte_pair_backend(tokenizer)
        pipeline = f"{type(tokenizer).__name__}{backend.to_str() if backend else ''}{end_of_text}"
    vocab_key = hashlib.sha256(
        ("\n".join(tokenizer.get_vocabulary()) + pipeline).encode()
    ).hexdigest()[:12]
    stores = {
        split: token_store(
            functools.partial(text.documents, split), tokenizer,
            cache / f"tokens-{text.fingerprint}-{vocab_key}-{split}.npy",
            num_documents=text.num_documents(split), verbose=verbose,
            what=f"The {split} token store of {source!r}", end_of_text=end_of_text,
        )
        for split in ("train", "validation")
    }
    share, shares = process_batch_share(global_batch_size)
    process = dict(
        process_index=share,
        process_count=shares,
        end_of_text_id=tokenizer.token_to_id(end_of_text) if document_mask else None,
    )
    train = LMBatches(stores["train"], sequence_length, global_batch_size, seed,
                      start_step=start_step, workers=prefetch, **process)
    full_validation_steps = (len(stores["validation"]) - 1) // sequence_length // global_batch_size
    if full_validation_steps < 1:
        raise ValueError(
            f"The validation split has {len(stores['validation'])} tokens, less than one "
            f"global batch of {global_batch_size} x {sequence_length}. Use a smaller batch or "
            f"sequence_length, or a larger corpus."
        )
    steps = min(validation_steps or full_validation_steps, full_validation_steps)
    # Separate replica group jobs each validate the whole batch (the same outer weights).
    validation_share, validation_shares = process_batch_share(global_batch_size, groups=False)
    validation = LMBatches(
        stores["validation"], sequence_length, global_batch_size, shuffle=False,
        num_steps=steps, spread=True,
        **dict(process, process_index=validation_share, process_count=validation_shares),
    )
    split_tokens = full_validation_steps * global_batch_size * sequence_length
    if steps == full_validation_steps:
        coverage = (f"the whole validation split: {steps} batches, {split_tokens:,} tokens "
                    f"in order")
    else:
        coverage = (f"{steps} of the validation split's {full_validation_steps} batches "
                    f"({steps * global_batch_size * sequence_length:,} of {split_tokens:,} "
                    f"tokens), windows evenly strided over the whole split")
    return LMData(
        train=train,
        validation=validation,
        tokenizer=tokenizer,
        vocabulary_size=tokenizer.vocabulary_size(),
        train_tokens=len(stores["train"]),
        validation_tokens=len(stores["validation"]),
        validation_coverage=coverage,
    )
