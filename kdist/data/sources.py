"""Text sources streamed document by document: the embedded corpus, local files, TFDS.

A source spec names where the text comes from:

* ``"python-stdlib"`` — the embedded default corpus (:mod:`kdist.data.corpus`);
* a local text file, directory or glob (``"data/*.txt"``, ``"~/books/"``);
* ``"tfds:NAME"`` — a TensorFlow Datasets dataset by name, e.g. ``"tfds:tiny_shakespeare"``,
  ``"tfds:lm1b"``, ``"tfds:wikipedia/20230601.en"``, ``"tfds:c4/en"``.

Every source gives a ``fingerprint`` (for cache keys) without reading its text, and
``documents(split)``, a generator over the ``"train"`` or ``"validation"`` documents: a corpus
larger than memory is never held whole. TFDS datasets are read with ``tfds.data_source``
(random access) when they were prepared in a random-access format (ArrayRecord), else with
``tfds.load`` (TFRecord, through tf.data). They must be prepared already, or be preparable
offline from ``manual_dir``; downloading is opt-in (``download=True``), because without a
network TFDS retries for minutes before it fails. TFDS is the ``tfds`` extra
(``pip install 'kdist[tfds]'``), imported when a TFDS source is opened.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from kdist._optional import optional_import
from kdist.data.corpus import (
    STDLIB,
    canonical_encoding,
    is_validation,
    load_corpus,
    local_files,
    read_text,
)

SPLITS = ("train", "validation")
TFDS_PREFIX = "tfds:"
_VALIDATION_NAMES = ("validation", "valid", "dev", "test")


def _tfds():
    return optional_import("tensorflow_datasets", "Reading a TFDS dataset")


class TextSource:
    """A named collection of documents in two splits, streamed.

    Subclasses set ``name`` and ``fingerprint`` and implement ``documents(split)``;
    ``num_documents(split)`` may return None when unknown (the progress bar then counts up).
    """

    name: str
    fingerprint: str

    def documents(self, split: str) -> Iterator[str]:
        raise NotImplementedError

    def num_documents(self, split: str) -> int | None:
        return None

    def sample(self, max_characters: int) -> Iterator[str]:
        """Training documents until ``max_characters`` are reached (for tokenizer training)."""
        seen = 0
        for text in self.documents("train"):
            if seen >= max_characters:
                return
            seen += len(text)
            yield text

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}; got {split!r}.")


class CorpusSource(TextSource):
    """The embedded corpus (or one local file cut into pieces): small enough to read at once."""

    def __init__(self, source: str = STDLIB, encoding: str = "utf-8"):
        self._corpus = load_corpus(source, encoding=encoding)
        self.name = source
        self.fingerprint = self._corpus.fingerprint

    def documents(self, split: str) -> Iterator[str]:
        self._check_split(split)
        yield from getattr(self._corpus, split)

    def num_documents(self, split: str) -> int:
        self._check_split(split)
        return len(getattr(self._corpus, split))


class FilesSource(TextSource):
    """Local text files, one document per file, read one at a time.

    The split is by a hash of each file's relative path (as for the embedded corpus); the
    fingerprint hashes relative paths, sizes and modification times, so editing a file
    makes a new token store. Files are decoded with ``encoding``: a file with bytes not valid
    in it gets a warning (naming it and the count), and one with more than 0.1% of its bytes
    invalid is refused (:func:`kdist.data.checks.decode_text`).
    """

    def __init__(self, source: str, validation_fraction: float = 0.05,
                 encoding: str = "utf-8"):
        root, files = local_files(source)
        self.name = source
        self._root = root
        self._encoding = canonical_encoding(encoding)
        self._split = {"train": [], "validation": []}
        digest = hashlib.sha256(source.encode())
        if self._encoding != "utf-8":  # another decoding is another text (and store)
            digest.update(f"|{self._encoding}\n".encode())
        for path in files:
            relative = str(path.relative_to(root))
            stat = path.stat()
            digest.update(f"{relative}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
            side = "validation" if is_validation(relative, validation_fraction) else "train"
            self._split[side].append(path)
        if not self._split["train"] or not self._split["validation"]:
            raise ValueError(
                f"Source {source!r} has {len(self._split['train'])} training and "
                f"{len(self._split['validation'])} validation files; both must be non-empty. "
                f"Provide more files (about 20 or more), or a single file (which is cut into "
                f"pieces)."
            )
        self.fingerprint = digest.hexdigest()[:16]

    def documents(self, split: str) -> Iterator[str]:
        self._check_split(split)
        for path in self._split[split]:
            text = read_text(path, self._encoding)
            if text.strip():
                yield text

    def num_documents(self, split: str) -> int:
        self._check_split(split)
        return len(self._split[split])


class TFDSSource(TextSource):
    """A TFDS dataset's text feature, streamed from the prepared files.

    Args:
        name: the TFDS name, ``"dataset[/config][:version]"``.
        data_dir: where prepared datasets live (default: TFDS's, ``$TFDS_DATA_DIR`` or
            ``~/tensorflow_datasets``).
        manual_dir: a directory holding the dataset's source files, for datasets that must
            be (or can be) prepared offline from a manual download.
        download: allow TFDS to download and prepare the dataset if it is not prepared.
        text_key: the feature holding the text; default ``"text"``, or the only text feature.
        train_split, validation_split: TFDS split specs; by default ``"train"`` and the first
            of validation/valid/dev/test, else the last 1% of train (and train the rest).

    Example:
        >>> source = TFDSSource("tiny_shakespeare", manual_dir="~/downloads")  # doctest: +SKIP
        >>> next(source.documents("train"))[:9]                                 # doctest: +SKIP
        'First Cit'
    """

    def __init__(
        self,
        name: str,
        data_dir: str | os.PathLike | None = None,
        manual_dir: str | os.PathLike | None = None,
        download: bool = False,
        text_key: str | None = None,
        train_split: str | None = None,
        validation_split: str | None = None,
    ):
        tfds = _tfds()

        self.name = f"{TFDS_PREFIX}{name}"
        self._data_dir = None if data_dir is None else str(Path(data_dir).expanduser())
        try:
            builder = tfds.builder(name, data_dir=self._data_dir)
        except Exception as error:  # DatasetNotFoundError and friends
            raise ValueError(
                f"TFDS has no dataset {name!r} ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}). Use a registered name "
                f"such as 'tiny_shakespeare', 'lm1b', 'wikipedia/20230601.en' or 'c4/en' "
                f"(see tfds.list_builders()), or import the module that defines your builder."
            ) from None
        if not builder.is_prepared():
            self._prepare(builder, name, manual_dir, download)
        self._builder = builder
        config = builder.builder_config
        # Exactly this dataset: name, config and version (full_name's "a/b/1.0.0" reads as
        # a config named "b/1.0.0" in tfds.load).
        self._load_name = (f"{builder.name}{'/' + config.name if config else ''}"
                           f":{builder.version}")
        info = builder.info
        self._text_key = self._pick_text_key(info, text_key, name)
        names = list(info.splits)
        if "train" not in names:
            raise ValueError(
                f"TFDS dataset {name!r} has no 'train' split (it has {names}). Pass "
                f"train_split= and validation_split= explicitly."
            )
        validation = next((s for s in _VALIDATION_NAMES if s in names), None)
        default_train = "train" if validation else "train[:99%]"
        self._splits = {
            "train": train_split or default_train,
            "validation": validation_split or validation or "train[99%:]",
        }
        from tensorflow_datasets.core import file_adapters

        random_access = file_adapters.FileFormat.with_random_access()
        self.random_access = bool(set(info.available_file_formats()) & set(random_access))
        key = (f"{info.full_name}|{self._text_key}|{self._splits}|"
               f"{[(s, info.splits[s].num_examples) for s in sorted(names)]}")
        self.fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]

    @staticmethod
    def _prepare(builder, name, manual_dir, download) -> None:
        tfds = _tfds()

        if manual_dir is None and not download:
            raise ValueError(
                f"TFDS dataset {name!r} is not prepared in {builder.data_dir_root}. Prepare it "
                f"once (`tfds build {name} --data_dir DIR`, or on a machine with network), then "
                f"pass that data dir (--tfds-data-dir); or put its source files in a directory "
                f"and pass it as manual_dir (--tfds-manual-dir); or allow downloading "
                f"(download=True, --tfds-download)."
            )
        config = tfds.download.DownloadConfig(
            manual_dir=None if manual_dir is None else str(Path(manual_dir).expanduser())
        )
        builder.download_and_prepare(download_config=config)

    @staticmethod
    def _pick_text_key(info, text_key, name) -> str:
        tfds = _tfds()

        features = info.features
        keys = list(features.keys()) if hasattr(features, "keys") else []
        if text_key is not None:
            if text_key not in keys:
                raise ValueError(
                    f"TFDS dataset {name!r} has no feature {text_key!r}; its features are "
                    f"{keys}. Pass one of them as text_key."
                )
            return text_key
        if "text" in keys:
            return "text"
        texts = [k for k in keys if isinstance(features[k], tfds.features.Text)]
        if len(texts) != 1:
            raise ValueError(
                f"Cannot tell which feature of TFDS dataset {name!r} holds the text: its "
                f"features are {keys}. Pass text_key= (e.g. {texts[0] if texts else keys})."
            )
        return texts[0]

    def num_documents(self, split: str) -> int:
        self._check_split(split)
        return self._builder.info.splits[self._splits[split]].num_examples

    def documents(self, split: str) -> Iterator[str]:
        self._check_split(split)
        if self.random_access:
            yield from self._from_data_source(self._splits[split])
        else:
            yield from self._from_tf_data(self._splits[split])

    def _from_data_source(self, split: str, chunk: int = 256) -> Iterator[str]:
        tfds = _tfds()

        source = tfds.data_source(
            self._load_name, split=split, data_dir=self._data_dir, download=False
        )
        for start in range(0, len(source), chunk):
            for example in source.__getitems__(range(start, min(start + chunk, len(source)))):
                yield _text(example[self._text_key])

    def _from_tf_data(self, split: str) -> Iterator[str]:
        tfds = _tfds()
        tf = optional_import("tensorflow", "Reading a TFRecord TFDS dataset (tf.data)")

        try:
            tf.config.set_visible_devices([], "GPU")  # the accelerator memory is JAX's
        except RuntimeError:  # TensorFlow started its devices already; nothing to change
            pass
        dataset = tfds.load(
            self._load_name, split=split, data_dir=self._data_dir,
            download=False, shuffle_files=False,
        )
        for example in tfds.as_numpy(dataset):
            yield _text(example[self._text_key])


def _text(value) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def text_source(
    source: str = STDLIB,
    tfds_data_dir: str | os.PathLike | None = None,
    tfds_manual_dir: str | os.PathLike | None = None,
    tfds_download: bool = False,
    encoding: str = "utf-8",
) -> TextSource:
    """The :class:`TextSource` for a source spec (see the module docstring).

    ``encoding`` is for local text files (TFDS text is UTF-8; so is the standard library).

    Example:
        >>> source = text_source("python-stdlib")
        >>> sum(1 for _ in source.documents("validation")) == source.num_documents("validation")
        True
    """
    if not isinstance(source, str) or not source:
        raise ValueError(
            f"Data source must be a non-empty string: {STDLIB!r}, a path or glob, or "
            f"'tfds:NAME'; got {source!r}."
        )
    if source.startswith(TFDS_PREFIX):
        return TFDSSource(source[len(TFDS_PREFIX):], data_dir=tfds_data_dir,
                          manual_dir=tfds_manual_dir, download=tfds_download)
    if source == STDLIB:
        return CorpusSource(source)
    path = Path(source).expanduser()
    if path.is_file():  # one file: cut into pieces, so that it can be split
        return CorpusSource(source, encoding=encoding)
    return FilesSource(source, encoding=encoding)

