"""The embedded corpus and local text sources."""

import sysconfig

import pytest

from kdist.data.corpus import is_validation, load_corpus, stdlib_files


def test_stdlib_corpus_is_real_split_by_file_and_deterministic():
    root, files = stdlib_files()
    assert root == __import__("pathlib").Path(sysconfig.get_paths()["stdlib"])
    names = {str(f.relative_to(root)) for f in files}
    assert "os.py" in names and "json/decoder.py" in names
    assert not any("site-packages" in n or n.startswith("test/") for n in names)
    corpus = load_corpus()
    again = load_corpus()
    assert corpus.fingerprint == again.fingerprint and corpus.validation == again.validation
    assert sum(map(len, corpus.train)) > 5_000_000
    assert 0.02 < len(corpus.validation) / len(files) < 0.1
    # Whole files go to one side: no document appears in both.
    assert not set(corpus.train) & set(corpus.validation)


def test_split_is_a_function_of_the_path():
    assert is_validation("a/b.py", 0.5) == is_validation("a/b.py", 0.5)
    share = sum(is_validation(f"f{i}.py", 0.1) for i in range(10_000)) / 10_000
    assert 0.09 < share < 0.11


def test_local_directory_and_single_file(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}\n" * 20)
    corpus = load_corpus(str(tmp_path), validation_fraction=0.2)
    assert len(corpus.train) + len(corpus.validation) == 40
    single = tmp_path / "one.txt"
    single.write_text("".join(f"line {i}\n" for i in range(1000)))
    corpus = load_corpus(str(single), validation_fraction=0.2)
    assert len(corpus.train) + len(corpus.validation) == 100


def test_missing_source_is_explained():
    with pytest.raises(ValueError, match="neither 'python-stdlib' nor an existing file"):
        load_corpus("/no/such/corpus")


def test_local_files_are_decoded_with_the_given_encoding(tmp_path):
    single = tmp_path / "livre.txt"
    single.write_bytes("".join(f"ligne {i}: là, où\n" for i in range(1000)).encode("latin-1"))
    with pytest.raises(ValueError, match="livre.txt: 2,000 of .* --encoding latin-1"):
        load_corpus(str(single))
    corpus = load_corpus(str(single), encoding="latin-1")
    assert "ligne 0: là, où\n" in corpus.train[0] + corpus.validation[0]
    assert corpus.fingerprint != load_corpus(str(single), encoding="cp1252").fingerprint
    with pytest.raises(ValueError, match="Unknown text encoding 'nope'"):
        load_corpus(str(single), encoding="nope")
