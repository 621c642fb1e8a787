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
import hashlib
import os
from functools import lru_cache
from pathlib import Path

import keras
import numpy as np

from kdist.data.corpus import STDLIB, load_corpus
from kdist.data.tokenizer import END_OF_TEXT, byte_pair_tokenizer, cache_root
from kdist.distribution import process_batch_share, replica_count

_ENCODE_CHUNK = 64  # documents per tokenizer call


def token_store(documents, tokenizer, path: Path) -> np.ndarray:
    """Tokenizes documents into ``path`` (once) and returns the memory-mapped stream."""
    if not path.exists():
        eot = tokenizer.token_to_id(END_OF_TEXT)
        dtype = np.uint16 if tokenizer.vocabulary_size() <= 2**16 else np.uint32
        pieces = []
        for start in range(0, len(documents), _ENCODE_CHUNK):
            for ids in tokenizer.tokenize(documents[start : start + _ENCODE_CHUNK]):
                pieces.append(np.asarray(ids, dtype=dtype))
                pieces.append(np.asarray([eot], dtype=dtype))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npy")
        np.save(tmp, np.concatenate(pieces))
        os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


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
        end_of_text_id: if set, inputs are ``{"token_ids", "segment_ids"}`` where segment
            ids count the documents (end-of-text tokens) before each position, for
            document-aware attention; the end-of-text token closes its own document.

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
    ):
        super().__init__()
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
        self.num_windows = (len(tokens) - 1) // sequence_length
        if self.num_windows < 1:
            raise ValueError(
                f"The token stream has {len(tokens)} tokens, fewer than one window of "
                f"sequence_length + 1 = {sequence_length + 1}. Use more text or a shorter "
                f"sequence_length."
            )
        self._offsets = np.arange(sequence_length + 1)

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
    """What :func:`lm_dataset` returns: datasets plus what a script needs to know."""

    train: LMBatches
    validation: LMBatches
    tokenizer: object
    vocabulary_size: int
    train_tokens: int
    validation_tokens: int


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
) -> LMData:
    """Causal-LM data from a corpus: tokenizer, token store, train and validation batches.

    The tokenizer is trained on the training split when not cached yet; the token store is
    written once per (corpus, tokenizer). With ``document_mask=True`` the inputs carry
    segment ids, for a model built with ``document_mask=True``. The global batch must
    divide by the number of replicas of the active distribution (``data * fsdp``) and by
    the process count; each process's datasets yield only its share of every global batch.

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
    cache = Path(cache_dir) if cache_dir is not None else cache_root()
    corpus = load_corpus(source)
    tokenizer = byte_pair_tokenizer(corpus, vocabulary_size, cache)
    vocab_key = hashlib.sha256(
        "\n".join(tokenizer.get_vocabulary()).encode()
    ).hexdigest()[:12]
    stores = {
        split: token_store(
            getattr(corpus, split), tokenizer,
            cache / f"tokens-{corpus.fingerprint}-{vocab_key}-{split}.npy",
        )
        for split in ("train", "validation")
    }
    share, shares = process_batch_share(global_batch_size)
    process = dict(
        process_index=share,
        process_count=shares,
        end_of_text_id=tokenizer.token_to_id(END_OF_TEXT) if document_mask else None,
    )
    train = LMBatches(stores["train"], sequence_length, global_batch_size, seed,
                      start_step=start_step, **process)
    full_validation_steps = (len(stores["validation"]) - 1) // sequence_length // global_batch_size
    if full_validation_steps < 1:
        raise ValueError(
            f"The validation split has {len(stores['validation'])} tokens, less than one "
            f"global batch of {global_batch_size} x {sequence_length}. Use a smaller batch or "
            f"sequence_length, or a larger corpus."
        )
    validation = LMBatches(
        stores["validation"], sequence_length, global_batch_size, shuffle=False,
        num_steps=min(validation_steps or full_validation_steps, full_validation_steps),
        **process,
    )
    return LMData(
        train=train,
        validation=validation,
        tokenizer=tokenizer,
        vocabulary_size=tokenizer.vocabulary_size(),
        train_tokens=len(stores["train"]),
        validation_tokens=len(stores["validation"]),
    )
