"""The on-disk token store: streamed, atomic, built once between concurrent builders."""

import json
import threading

import numpy as np
import pytest
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

from kdist.data import LMBatches, token_store
from kdist.data.token_store import _ENCODE_CHUNK, store_id_range


class CharTokenizer:
    """One id per character (the end-of-text id is 0); counts the documents it encodes."""

    def __init__(self):
        self.encoded = 0
        self.lock = threading.Lock()

    def token_to_id(self, token):
        return 0

    def vocabulary_size(self):
        return 256

    def tokenize(self, documents):
        assert isinstance(documents, list) and len(documents) <= _ENCODE_CHUNK
        with self.lock:
            self.encoded += len(documents)
        return [[ord(c) for c in d] for d in documents]


def expected_stream(documents):
    return np.concatenate([[*map(ord, d), 0] for d in documents if d.strip()])


def test_documents_are_streamed_chunk_by_chunk(tmp_path):
    documents = [f"doc {i} " * (1 + i % 5) for i in range(1000)]
    documents[10], documents[500] = "", "  \n"  # blank documents are skipped
    pulled = []

    def stream():  # a generator with no len(): the store may not hold it whole
        for d in documents:
            pulled.append(d)
            yield d

    tokenizer = CharTokenizer()
    original = tokenizer.tokenize

    def tokenize(chunk):
        # When a chunk is encoded, little more than that chunk (and the empty documents
        # skipped on the way) has been read from the stream.
        assert len(pulled) - tokenizer.encoded <= 2 * _ENCODE_CHUNK
        return original(chunk)

    tokenizer.tokenize = tokenize
    path = tmp_path / "tokens.npy"
    tokens = token_store(stream, tokenizer, path, num_documents=len(documents), verbose=False)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, expected_stream(documents))
    np.testing.assert_array_equal(np.load(path), tokens)  # an ordinary .npy file
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tokens.npy", "tokens.npy.lock", "tokens.npy.meta.json"]


def test_a_crash_leaves_no_store_and_the_next_build_cleans_up(tmp_path):
    def failing():
        yield from ["one", "two"] * 100
        raise RuntimeError("disk on fire")

    path = tmp_path / "tokens.npy"
    with pytest.raises(RuntimeError, match="disk on fire"):
        token_store(failing, CharTokenizer(), path, verbose=False)
    assert not path.exists()  # nothing that looks like a finished store
    assert list(tmp_path.glob("tokens.npy.tmp*"))  # the half-written file, under its temp name
    tokens = token_store(lambda: iter(["abc", "de"]), CharTokenizer(), path, verbose=False)
    np.testing.assert_array_equal(tokens, expected_stream(["abc", "de"]))
    assert not list(tmp_path.glob("tokens.npy.tmp*"))


def test_concurrent_builders_tokenize_once_and_share_the_store(tmp_path):
    documents = [f"text {i}" for i in range(2000)]
    tokenizers = [CharTokenizer() for _ in range(3)]
    results = [None] * 3

    def build(k):
        results[k] = token_store(lambda: iter(documents), tokenizers[k], tmp_path / "t.npy",
                                 verbose=False)

    threads = [threading.Thread(target=build, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(t.encoded for t in tokenizers) == [0, 0, len(documents)]
    for tokens in results:
        np.testing.assert_array_equal(tokens, expected_stream(documents))


def test_prefetching_threads_serve_the_same_batches_in_order():
    tokens = np.arange(20_000) % 50_000
    inline = LMBatches(tokens, 16, 8, seed=3)
    ahead = LMBatches(tokens, 16, 8, seed=3, workers=2, max_queue_size=4)
    served = PyDatasetAdapter(ahead, shuffle=False).get_numpy_iterator()
    for step in range(12):
        x, y = next(served)
        np.testing.assert_array_equal(x, inline[step][0])
        np.testing.assert_array_equal(y, inline[step][1])


class OffsetTokenizer(CharTokenizer):
    """Emits ``ord(c)``, plus ``offset`` for x, y and z: ids outside its vocabulary."""

    def __init__(self, offset, size=256):
        super().__init__()
        self.offset, self.size = offset, size

    def vocabulary_size(self):
        return self.size

    def tokenize(self, documents):
        return [[ord(c) + self.offset * (c in "xyz") for c in d] for d in documents]


@pytest.mark.parametrize("offset, found, first", [
    (200, r"\[0, 322\]", 320), (65_536, r"\[0, 65658\]", 65_656), (-200, r"\[-80, 97\]", -80)])
def test_ids_outside_the_vocabulary_stop_the_build(tmp_path, offset, found, first):
    # 65,536 + c would wrap to c in the uint16 store: the check runs before the cast.
    path = tmp_path / "tokens.npy"
    documents = ["a" * 100] * 70 + ["xyz"]  # the bad id is in the second chunk of 64
    with pytest.raises(ValueError, match=f"The token store tokens.npy has token ids in "
                                         f"{found}.*outside the valid range \\[0, 256\\)"
                                         f".*produced id {first} at token 7,070 "
                                         f"of the stream \\(documents 64-70\\)"):
        token_store(lambda: iter(documents), OffsetTokenizer(offset), path, verbose=False)
    assert not path.exists() and not list(tmp_path.glob("tokens.npy.tmp*"))


def test_the_store_records_its_id_range_and_is_checked_when_opened(tmp_path):
    path = tmp_path / "tokens.npy"
    token_store(lambda: iter(["abc", "z"]), CharTokenizer(), path, verbose=False)
    meta = json.loads((tmp_path / "tokens.npy.meta.json").read_text())
    assert (meta["min_id"], meta["max_id"]) == (0, ord("z"))  # 0: end-of-text
    # The same store opened with a smaller vocabulary (another tokenizer's cache, say).
    with pytest.raises(ValueError, match=f"train store has token ids in \\[0, {ord('z')}\\]"
                                         f".*\\[0, 100\\).*delete {path}"):
        token_store(lambda: iter([]), OffsetTokenizer(0, size=100), path, what="train store")
    # A store written before the metadata existed: one pass, then cached.
    (tmp_path / "tokens.npy.meta.json").unlink()
    assert store_id_range(path) == (0, ord("z"))
    assert json.loads((tmp_path / "tokens.npy.meta.json").read_text())["max_id"] == ord("z")
