"""Text-classification data for fine-tuning BERT: an offline task, or any TFDS dataset.

**Offline default, ``"stdlib-packages"``**: from a window of source code, predict which
top-level package of the Python standard library it comes from (``asyncio``, ``email``,
``idlelib``, ``importlib``, ``multiprocessing``, ``xml`` — packages with 20+ files in every
Python from 3.10 on). Real text, real labels, no download. Files are split, per package,
by a hash of their path, so no file — and no line of text — is in both train and
validation; each split has every class.

**TFDS**: any text-classification dataset by name (``"imdb_reviews"``, ``"glue/sst2"``,
``"ag_news_subset"`` ...) through ``tfds.load``. The text and label features are found from
the dataset's info (its supervised keys, else its ``Text`` and ``ClassLabel`` features).
Without network, prepare the data beforehand (``tfds build NAME``, or ``download=True`` on a
machine that has network) and pass its ``data_dir``; kdist does not wait minutes for a
download that cannot happen. TFDS is the ``tfds`` extra (``pip install 'kdist[tfds]'``).

Examples are encoded ``[CLS] text [SEP] [PAD] ...`` (cut to the sequence length) with
the BERT tokenizer of the pretraining run, and served by :class:`ClassificationBatches`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import keras
import numpy as np

from kdist._optional import optional_import
from kdist.data.corpus import stdlib_files
from kdist.data.sampling import StepSampler
from kdist.data.wordpiece import CLS, PAD, SEP
from kdist.parallel.layout import replica_count

STDLIB_PACKAGES_TASK = "stdlib-packages"
DEFAULT_PACKAGES = ("asyncio", "email", "idlelib", "importlib", "multiprocessing", "xml")


@dataclasses.dataclass
class TextClassificationTask:
    """Texts and integer labels of a train and a validation split.

    ``train_groups``/``validation_groups`` name where each example comes from (the source
    file, for the offline task), so a test can check that no group is in both splits.
    """

    name: str
    class_names: list[str]
    train_texts: list[str]
    train_labels: np.ndarray
    validation_texts: list[str]
    validation_labels: np.ndarray
    train_groups: list[str] | None = None
    validation_groups: list[str] | None = None


def _hash_order(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def stdlib_package_task(
    packages=DEFAULT_PACKAGES, validation_fraction: float = 0.25, window_lines: int = 8
) -> TextClassificationTask:
    """The offline task: windows of ``window_lines`` non-empty source lines, labelled with
    their top-level standard-library package; files split per package by path hash.

    Example:
        >>> task = stdlib_package_task()
        >>> task.class_names[:2], len(task.train_texts) > len(task.validation_texts) > 0
        (['asyncio', 'email'], True)
    """
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1); got {validation_fraction}.")
    root, files = stdlib_files()
    by_package: dict[str, list] = {p: [] for p in packages}
    for path in files:
        parts = path.relative_to(root).parts
        if len(parts) > 1 and parts[0] in by_package:
            by_package[parts[0]].append(path)
    few = {p: len(f) for p, f in by_package.items() if len(f) < 2}
    if few:
        raise ValueError(f"Packages {few} have fewer than 2 source files in this Python's "
                         f"standard library ({root}); choose packages with more files.")
    splits = {"train": ([], [], []), "validation": ([], [], [])}
    for label, paths in enumerate(by_package.values()):
        ordered = sorted(paths, key=lambda p: _hash_order(str(p.relative_to(root))))
        held_out = max(1, round(validation_fraction * len(ordered)))
        for i, path in enumerate(ordered):
            texts, labels, groups = splits["validation" if i < held_out else "train"]
            lines = [line for line in path.read_text(encoding="utf-8", errors="replace")
                     .splitlines() if line.strip()]
            for start in range(0, len(lines), window_lines):
                window = lines[start : start + window_lines]
                if len(window) * 2 < window_lines:  # a short tail window
                    continue
                texts.append("\n".join(window))
                labels.append(label)
                groups.append(str(path.relative_to(root)))
    (tt, tl, tg), (vt, vl, vg) = splits["train"], splits["validation"]
    return TextClassificationTask(
        STDLIB_PACKAGES_TASK, list(packages), tt, np.asarray(tl, np.int32), vt,
        np.asarray(vl, np.int32), tg, vg,
    )


def tfds_task(
    name: str,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
    train_split: str = "train",
    validation_split: str | None = None,
    max_examples: int | None = None,
) -> TextClassificationTask:
    """A TFDS text-classification dataset via ``tfds.load``.

    ``validation_split`` defaults to ``"validation"`` if the dataset has one, else
    ``"test"``; examples labelled -1 (GLUE's unlabelled test sets) are dropped.
    ``max_examples`` keeps the first N of each split.

    Example:
        >>> task = tfds_task("imdb_reviews", data_dir="~/tensorflow_datasets")  # doctest: +SKIP
    """
    tfds = optional_import("tensorflow_datasets", "A TFDS classification task")

    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as error:  # DatasetNotFoundError and friends
        raise ValueError(f"TFDS has no dataset {name!r} ({type(error).__name__}: {error}). "
                         f"Use a registered name such as 'imdb_reviews' or 'glue/sst2'.") from None
    info = builder.info
    splits = list(info.splits.keys()) if info.splits else []
    if not download and not splits:
        raise ValueError(
            f"TFDS dataset {name!r} is not prepared in {builder.data_dir} and download=False "
            f"(this machine may have no network). Prepare it first ('tfds build {name}' where "
            f"there is network, then copy the data directory) and pass its data_dir, or pass "
            f"download=True."
        )
    if validation_split is None:
        validation_split = "validation" if "validation" in splits else "test"
    text_key, label_key = _text_and_label_keys(info, name)
    label_feature = info.features[label_key]
    optional_import("tensorflow", "A TFDS classification task (tfds.load reads with tf.data)")
    (train, validation), info = tfds.load(
        name, split=[train_split, validation_split], data_dir=data_dir, download=download,
        with_info=True,
    )

    def read(dataset):
        texts, labels = [], []
        for example in tfds.as_numpy(dataset.take(max_examples) if max_examples else dataset):
            label = int(example[label_key])
            if label < 0:
                continue
            text = example[text_key]
            texts.append(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)
            labels.append(label)
        return texts, np.asarray(labels, np.int32)

    train_texts, train_labels = read(train)
    validation_texts, validation_labels = read(validation)
    return TextClassificationTask(name, list(label_feature.names), train_texts, train_labels,
                                  validation_texts, validation_labels)


def _text_and_label_keys(info, name: str) -> tuple[str, str]:
    tfds = optional_import("tensorflow_datasets", "A TFDS classification task")

    if info.supervised_keys and len(info.supervised_keys) == 2:
        text_key, label_key = info.supervised_keys
        if isinstance(text_key, str) and isinstance(label_key, str):
            return text_key, label_key
    features = info.features
    texts = [k for k, f in features.items() if isinstance(f, tfds.features.Text)]
    labels = [k for k, f in features.items() if isinstance(f, tfds.features.ClassLabel)]
    if len(texts) != 1 or len(labels) != 1:
        raise ValueError(
            f"TFDS dataset {name!r} is not a single-text classification dataset: it has text "
            f"features {texts} and class-label features {labels} (exactly one of each needed)."
        )
    return texts[0], labels[0]


def encode_texts(texts, tokenizer, sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
    """``[CLS] text [SEP]`` rows ``(N, T)`` (padded with ``[PAD]``, cut to ``T``) and lengths.

    Example:
        >>> from kdist.data.wordpiece import load_word_piece, SPECIAL_TOKENS
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "vocabulary.txt"
        >>> _ = p.write_text("\\n".join(list(SPECIAL_TOKENS) + ["a", "b"]))
        >>> ids, lengths = encode_texts(["a b a"], load_word_piece(p), 6)
        >>> ids.tolist(), lengths.tolist()
        ([[2, 5, 6, 5, 3, 0]], [5])
    """
    cls_id, sep_id, pad_id = (tokenizer.token_to_id(t) for t in (CLS, SEP, PAD))
    ids = np.full((len(texts), sequence_length), pad_id, np.int32)
    lengths = np.zeros(len(texts), np.int32)
    for start in range(0, len(texts), 256):
        for i, tokens in enumerate(tokenizer.tokenize(list(texts[start : start + 256]))):
            row = [cls_id, *np.asarray(tokens)[: sequence_length - 2].tolist(), sep_id]
            ids[start + i, : len(row)] = row
            lengths[start + i] = len(row)
    return ids, lengths


class ClassificationBatches(keras.utils.PyDataset):
    """Batches ``(inputs, labels, sample_weights)`` of encoded examples.

    Training (``shuffle=True``, endless): a pure function of (seed, step, process), as
    :class:`kdist.data.LMBatches`; index 0 is global step ``start_step`` (set by the
    ``Checkpoint`` callback on resume, so no batch is repeated or skipped). Evaluation
    (``shuffle=False``): every example exactly once, in order; the last batch is filled up
    with weight-0 copies, so a weighted metric is exact over the whole split.

    Example:
        >>> ds = ClassificationBatches(np.ones((5, 8), "int32"), np.full(5, 8),
        ...                            np.arange(5) % 2, global_batch_size=4, shuffle=False)
        >>> len(ds), ds[1][2].tolist()
        (2, [1.0, 0.0, 0.0, 0.0])
    """

    def __init__(self, token_ids, lengths, labels, global_batch_size: int, seed: int = 0,
                 shuffle: bool = True, process_index: int = 0, process_count: int = 1,
                 start_step: int = 0):
        super().__init__()
        self.start_step = start_step
        self.token_ids, self.lengths, self.labels = token_ids, lengths, labels
        self.shuffle = shuffle
        self.global_batch_size = global_batch_size
        self.sampler = StepSampler(len(labels), global_batch_size, seed, shuffle,
                                   process_index, process_count)
        self.num_steps = None if shuffle else -(-len(labels) // global_batch_size)
        self._positions = np.arange(token_ids.shape[1])

    @property
    def num_batches(self):
        return self.num_steps

    def __len__(self):
        if self.num_steps is None:
            raise TypeError("Training ClassificationBatches are endless; use steps_per_epoch.")
        return self.num_steps

    def __getitem__(self, index: int):
        if self.num_steps is not None and not 0 <= index < self.num_steps:
            raise IndexError(f"Batch {index} is out of range for {self.num_steps} batches.")
        if self.shuffle:
            rows = self.sampler.rows(self.start_step + index)
            weights = np.ones(len(rows), np.float32)
        else:
            samples = self.sampler.samples(index)
            weights = (samples < len(self.labels)).astype(np.float32)
            rows = np.where(weights > 0, samples, 0)
        inputs = {
            "token_ids": self.token_ids[rows],
            "segment_ids": np.zeros_like(self.token_ids[rows]),
            "padding_mask": (self._positions < self.lengths[rows, None]).astype(np.int32),
        }
        return inputs, self.labels[rows].astype(np.int32), weights


@dataclasses.dataclass
class ClassificationData:
    """What :func:`classification_dataset` returns.

    ``majority_baseline`` is the validation accuracy of always predicting the validation
    split's most frequent class (the best any constant prediction can do there).
    """

    train: ClassificationBatches
    validation: ClassificationBatches
    class_names: list[str]
    num_classes: int
    train_examples: int
    validation_examples: int
    majority_baseline: float
    task: TextClassificationTask


def classification_dataset(
    task: str | TextClassificationTask = STDLIB_PACKAGES_TASK,
    tokenizer=None,
    sequence_length: int = 128,
    global_batch_size: int = 32,
    seed: int = 0,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
) -> ClassificationData:
    """Encoded, batched classification data: ``"stdlib-packages"`` (offline), a TFDS name,
    or a :class:`TextClassificationTask`, with the BERT ``tokenizer``.

    Example:
        >>> from kdist.data import load_corpus, word_piece_tokenizer
        >>> tok = word_piece_tokenizer(load_corpus())
        >>> data = classification_dataset("stdlib-packages", tok, 128, 32)
        >>> data.num_classes, 0 < data.majority_baseline < 1
        (6, True)
    """
    import jax

    if tokenizer is None:
        raise ValueError("classification_dataset needs the BERT tokenizer (e.g. "
                         "kdist.data.word_piece_tokenizer(...) or the pretraining run's).")
    replicas = replica_count()
    if global_batch_size % replicas:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by the {replicas} model "
            f"replicas (data x fsdp) of the active mesh. Use a multiple of {replicas}."
        )
    if isinstance(task, str):
        task = (stdlib_package_task() if task == STDLIB_PACKAGES_TASK
                else tfds_task(task, data_dir=data_dir, download=download))
    for split in ("train", "validation"):
        if not len(getattr(task, f"{split}_labels")):
            raise ValueError(f"Task {task.name!r} has no {split} examples.")
    process = dict(process_index=jax.process_index(), process_count=jax.process_count())
    train_ids, train_lengths = encode_texts(task.train_texts, tokenizer, sequence_length)
    val_ids, val_lengths = encode_texts(task.validation_texts, tokenizer, sequence_length)
    counts = np.bincount(task.validation_labels, minlength=len(task.class_names))
    return ClassificationData(
        train=ClassificationBatches(train_ids, train_lengths, task.train_labels,
                                    global_batch_size, seed, shuffle=True, **process),
        validation=ClassificationBatches(val_ids, val_lengths, task.validation_labels,
                                         global_batch_size, shuffle=False, **process),
        class_names=task.class_names,
        num_classes=len(task.class_names),
        train_examples=len(task.train_labels),
        validation_examples=len(task.validation_labels),
        majority_baseline=float(counts.max() / counts.sum()),
        task=task,
    )
