"""TFDS and local sources, through the same code path as a real dataset.

The TFDS builders are defined here and prepared into a temporary data_dir, then read back
by name with ``tfds.data_source`` (ArrayRecord) or ``tfds.load`` (TFRecord).
"""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from kdist.data import END_OF_TEXT, lm_dataset
from kdist.data.sources import FilesSource, TFDSSource, text_source

DOCUMENTS = [f"def f{i}(x):\n    return x + {i}\n" * (1 + i % 3) for i in range(120)]


class KdistTinyText(tfds.core.GeneratorBasedBuilder):
    """120 documents in train, 12 in test; an extra feature besides the text."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "index": tfds.features.Scalar(np.int64)}
            )
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(DOCUMENTS),
                "test": self._generate_examples(DOCUMENTS[:12])}

    def _generate_examples(self, documents):
        for i, text in enumerate(documents):
            yield i, {"text": text, "index": i}


class KdistManualText(tfds.core.GeneratorBasedBuilder):
    """Prepared offline from a file the user put in the manual-download directory."""

    VERSION = tfds.core.Version("1.0.0")
    MANUAL_DOWNLOAD_INSTRUCTIONS = "Put corpus.txt (documents separated by blank lines) here."

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({"content": tfds.features.Text()})
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(dl_manager.manual_dir / "corpus.txt")}

    def _generate_examples(self, path):
        for i, text in enumerate(path.read_text().split("\n\n")):
            yield i, {"content": text}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The tiny dataset prepared twice: as ArrayRecord and as TFRecord."""
    dirs = {}
    for file_format in ("array_record", "tfrecord"):
        dirs[file_format] = tmp_path_factory.mktemp(file_format)
        KdistTinyText(data_dir=dirs[file_format], file_format=file_format).download_and_prepare()
    return dirs


def test_tfds_both_file_formats_stream_the_documents(prepared):
    read = {}
    for file_format, data_dir in prepared.items():
        source = text_source("tfds:kdist_tiny_text", tfds_data_dir=data_dir)
        assert source.random_access == (file_format == "array_record")
        assert source.num_documents("train") == 120 and source.num_documents("validation") == 12
        read[file_format] = {s: list(source.documents(s)) for s in ("train", "validation")}
        assert sorted(read[file_format]["train"]) == sorted(DOCUMENTS)
        assert sorted(read[file_format]["validation"]) == sorted(DOCUMENTS[:12])  # "test"
    assert read["array_record"] == read["tfrecord"]  # same documents, same order
    fingerprints = {text_source("tfds:kdist_tiny_text", tfds_data_dir=d).fingerprint
                    for d in prepared.values()}
    assert len(fingerprints) == 1  # keyed by the dataset, not by where it is stored


def test_tfds_errors_say_how_to_fix(tmp_path):
    with pytest.raises(ValueError, match="is not prepared in .*--tfds-data-dir.*--tfds-manual"):
        TFDSSource("kdist_tiny_text", data_dir=tmp_path)  # fails at once: no network wait
    with pytest.raises(ValueError, match="TFDS has no dataset 'no_such_dataset_xyz'"):
        TFDSSource("no_such_dataset_xyz", data_dir=tmp_path)
    with pytest.raises(ValueError, match="has no feature 'body'; its features are"):
        TFDSSource("kdist_tiny_text", data_dir=tmp_path, download=True, text_key="body")


def test_tfds_prepares_offline_from_a_manual_dir(tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    texts = [f"paragraph {i}: " + "word " * i for i in range(200)]
    (manual / "corpus.txt").write_text("\n\n".join(texts))
    source = TFDSSource("kdist_manual_text", data_dir=tmp_path / "data", manual_dir=manual)
    train, validation = list(source.documents("train")), list(source.documents("validation"))
    # The only text feature is found; with no held-out split, the last 1% of train is one.
    assert len(train) == 198 and len(validation) == 2
    assert sorted(train + validation) == sorted(texts)


def test_lm_dataset_from_tfds_tokenizes_every_document_once(prepared, tmp_path):
    data = lm_dataset("tfds:kdist_tiny_text", sequence_length=16, global_batch_size=4,
                      vocabulary_size=300, cache_dir=tmp_path,
                      tfds_data_dir=prepared["array_record"], verbose=False)
    source = text_source("tfds:kdist_tiny_text", tfds_data_dir=prepared["array_record"])
    eot = data.tokenizer.token_to_id(END_OF_TEXT)
    expected = np.concatenate(
        [np.append(data.tokenizer.tokenize(d), eot) for d in source.documents("train")]
    )
    np.testing.assert_array_equal(data.train.tokens, expected)
    assert data.train_tokens == len(expected) and data.validation_tokens > 0
    assert len(list(tmp_path.glob("tokens-*.npy"))) == 2  # one store per split


def test_local_directory_is_streamed_by_file(tmp_path):
    for i in range(60):
        (tmp_path / f"f{i:02d}.txt").write_text(f"text of file {i}\n")
    source = text_source(str(tmp_path))
    assert isinstance(source, FilesSource)
    train, validation = list(source.documents("train")), list(source.documents("validation"))
    assert sorted(train + validation) == sorted(f"text of file {i}\n" for i in range(60))
    assert validation and source.num_documents("train") == len(train)
    before = source.fingerprint
    (tmp_path / "f00.txt").write_text("changed, longer text\n")
    assert text_source(str(tmp_path)).fingerprint != before  # a new token store


def latin1_directory(tmp_path):
    """60 UTF-8 files and one in latin-1 (accents every few bytes: ~2% not valid UTF-8)."""
    for i in range(60):
        (tmp_path / f"f{i:02d}.txt").write_text(f"text of file {i}\n")
    (tmp_path / "old.txt").write_bytes("déjà vu, café à côté\n".encode("latin-1") * 50)
    return tmp_path


def test_a_file_in_another_encoding_is_refused_naming_it_and_encoding(tmp_path):
    source = text_source(str(latin1_directory(tmp_path)))
    split = ("validation" if any(p.name == "old.txt" for p in source._split["validation"])
             else "train")
    with pytest.raises(ValueError, match=r"old.txt: 300 of 1,050 bytes \(28.57%\) are not valid "
                                         r"utf-8.*--encoding latin-1"):
        list(source.documents(split))
    latin = text_source(str(tmp_path), encoding="latin-1")
    assert "déjà vu, café à côté\n" * 50 in list(latin.documents(split))
    assert latin.fingerprint != source.fingerprint  # another decoding: another token store


def test_a_few_bad_bytes_are_counted_and_reported(tmp_path):
    for i in range(60):
        (tmp_path / f"f{i:02d}.txt").write_text(f"text of file {i}\n" * 100)
    (tmp_path / "f07.txt").write_bytes(b"caf\xe9 " + b"plain text\n" * 200)
    source = text_source(str(tmp_path))
    with pytest.warns(UnicodeWarning, match=r"f07.txt: 1 byte of 2,205 is not valid utf-8"):
        documents = [*source.documents("train"), *source.documents("validation")]
    assert "caf\ufffd " + "plain text\n" * 200 in documents


def test_lm_dataset_reads_a_latin1_file_with_its_encoding(tmp_path):
    single = tmp_path / "book.txt"
    single.write_bytes("".join(f"ligne {i}: déjà, café\n" for i in range(3000)).encode("latin-1"))
    with pytest.raises(ValueError, match="book.txt: 9,000 of .* --encoding latin-1"):
        lm_dataset(str(single), sequence_length=16, global_batch_size=8, vocabulary_size=512,
                   cache_dir=tmp_path / "cache", verbose=False)
    data = lm_dataset(str(single), sequence_length=16, global_batch_size=8, vocabulary_size=512,
                      cache_dir=tmp_path / "cache", verbose=False, encoding="latin-1")
    text = data.tokenizer.detokenize(data.validation.tokens[:200])
    assert "déjà, café" in text and "\ufffd" not in text
    with pytest.raises(ValueError, match="Unknown text encoding 'klingon'"):
        text_source(str(single), encoding="klingon")
