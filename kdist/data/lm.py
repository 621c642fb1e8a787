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

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import itertools
import os
import types
from functools import lru_cache
from pathlib import Path

import keras
import numpy as np

from kdist.data.corpus import STDLIB
from kdist.data.sources import text_source
from kdist.data.tokenizer import END_OF_TEXT, byte_pair_tokenizer, cache_root
from kdist.distribution import process_batch_share, replica_count

_ENCODE_CHUNK = 64  # documents per tokenizer call
# A fixed-size .npy header: written as a placeholder first, rewritten with the length last.
_HEADER_BYTES = 128
# Text used to train a byte-pair vocabulary when none is cached (the start of the training
# split): enough for a stable vocabulary, bounded for corpora of any size.
TOKENIZER_TRAINING_CHARACTERS = 64_000_000


@contextlib.contextmanager
def exclusive(lock_path: Path):
    """An exclusive lock between processes (``flock`` on ``lock_path``), held in the block.

    Processes that start together (the ranks of one job, or several jobs on one cache)
    then build a tokenizer or token store once, and the others wait and reuse it.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    """A version-1.0 ``.npy`` header for a 1-D array, padded to ``_HEADER_BYTES``."""
    text = (f"{{'descr': {np.lib.format.dtype_to_descr(np.dtype(dtype))!r}, "
            f"'fortran_order': False, 'shape': ({length},), }}")
    body = text.ljust(_HEADER_BYTES - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")


def token_store(
    documents, tokenizer, path: Path, num_documents: int | None = None, verbose: bool = True
) -> np.ndarray:
    """The memory-mapped token stream of ``documents``, tokenized into ``path`` once.

    ``documents`` is an iterable of strings, or a callable returning one (then it is only
    called if the store must be built). It is consumed in a single streaming pass, chunk by
    chunk, each document followed by the end-of-text id, with a progress bar
    (``num_documents`` sets its target): a corpus larger than memory is never held whole.
    The file is written under a temporary name and renamed when complete, while holding a
    lock: other processes wait and then reuse it, and a crash leaves no file that looks like
    a finished store (its leftover is removed by the next builder).

    Example:
        >>> tokens = token_store(["a b", "c"], tokenizer, Path("/tmp/t.npy"))  # doctest: +SKIP
    """
    path = Path(path)
    if not path.exists():
        with exclusive(path.with_name(path.name + ".lock")):
            if not path.exists():  # another process may have built it while we waited
                _write_token_store(documents, tokenizer, path, num_documents, verbose)
    return np.load(path, mmap_mode="r")


def _write_token_store(documents, tokenizer, path, num_documents, verbose) -> None:
    if callable(documents):
        documents = documents()
    eot = tokenizer.token_to_id(END_OF_TEXT)
    dtype = np.dtype(np.uint16 if tokenizer.vocabulary_size() <= 2**16 else np.uint32)
    for stale in path.parent.glob(path.name + ".tmp*"):  # a crashed builder's leftover
        stale.unlink()
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    progress = None
    if verbose:
        print(f"Tokenizing into {path.name} (once; later runs reuse it)", flush=True)
        progress = keras.utils.Progbar(num_documents, unit_name="document")
    length = done = 0
    documents = iter(documents)
    with open(tmp, "wb") as out:
        out.write(_npy_header(dtype, 0))
        while chunk := list(itertools.islice(documents, _ENCODE_CHUNK)):
            done += len(chunk)
            texts = [d for d in chunk if d.strip()]  # blank documents are left out
            pieces = []
            for ids in tokenizer.tokenize(texts) if texts else []:
                pieces += [np.asarray(ids, dtype=dtype), np.asarray([eot], dtype=dtype)]
            if pieces:
                array = np.concatenate(pieces)
                out.write(array.tobytes())
                length += array.size
            if progress is not None:
                progress.update(done)
        out.seek(0)
        out.write(_npy_header(dtype, length))
        out.flush()
        os.fsync(out.fileno())
    if verbose:
        print(f"{done:,} documents, {length:,} tokens", flush=True)
    os.replace(tmp, path)


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
        workers, max_queue_size: threads preparing batches ahead of the training step,
            and how many they may hold (Keras' ``PyDataset`` prefetching).

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
    tfds_data_dir: str | os.PathLike | None = None,
    tfds_manual_dir: str | os.PathLike | None = None,
    tfds_download: bool = False,
    prefetch: int = 2,
    verbose: bool = True,
) -> LMData:
    """Causal-LM data from a source: tokenizer, token store, train and validation batches.

    ``source`` is ``"python-stdlib"``, a local file/directory/glob or ``"tfds:NAME"`` (see
    :func:`kdist.data.sources.text_source`; the ``tfds_*`` arguments are for TFDS). The
    tokenizer is trained on the start of the training split when not cached yet; the token
    store is written once per (source, tokenizer), streaming. With ``document_mask=True``
    the inputs carry segment ids, for a model built with ``document_mask=True``. The global
    batch must divide by the number of replicas of the active distribution
    (``data * fsdp``); each process's datasets yield only its share of every global batch
    (:func:`kdist.distribution.process_batch_share`). ``prefetch`` threads prepare training
    batches ahead of the step (Keras' ``PyDataset`` workers); 1 prepares them in line.

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
    cache = Path(cache_dir) if cache_dir is not None else cache_root()
    text = text_source(source, tfds_data_dir, tfds_manual_dir, tfds_download)
    sample = types.SimpleNamespace(  # what byte_pair_tokenizer reads, streamed
        fingerprint=text.fingerprint, train=text.sample(TOKENIZER_TRAINING_CHARACTERS)
    )
    with exclusive(cache / f"bpe-{text.fingerprint}-{vocabulary_size}.lock"):
        tokenizer = byte_pair_tokenizer(sample, vocabulary_size, cache)
    vocab_key = hashlib.sha256(
        "\n".join(tokenizer.get_vocabulary()).encode()
    ).hexdigest()[:12]
    stores = {
        split: token_store(
            functools.partial(text.documents, split), tokenizer,
            cache / f"tokens-{text.fingerprint}-{vocab_key}-{split}.npy",
            num_documents=text.num_documents(split), verbose=verbose,
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
                      start_step=start_step, workers=prefetch, **process)
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
