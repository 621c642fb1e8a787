"""Tokenizer caching and the deterministic, per-process batches."""

import numpy as np
import pytest

import kdist.data.tokenizer as tokenizer_module
from kdist.data import END_OF_TEXT, LMBatches, lm_dataset
from kdist.data.corpus import load_corpus
from kdist.data.tokenizer import byte_pair_tokenizer


@pytest.fixture(scope="module")
def data():
    return lm_dataset(sequence_length=64, global_batch_size=8, vocabulary_size=1024)


def test_tokenizer_round_trips_and_is_cached(data, monkeypatch):
    tok = data.tokenizer
    text = load_corpus().validation[0][:3000]
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.vocabulary_size() == 1024 == data.vocabulary_size
    assert len(tok.tokenize(text)) < len(text) / 2  # it learned merges
    # A second request loads the cached vocabulary instead of training again.
    monkeypatch.setattr(tokenizer_module, "train_byte_pair", lambda *a: pytest.fail("retrained"))
    again = byte_pair_tokenizer(load_corpus(), 1024)
    assert again.get_vocabulary() == tok.get_vocabulary()


def test_a_cached_vocabulary_builds_no_tokenizer_until_one_is_read(data, monkeypatch):
    """Each rank or replica group on cached token stores reads only the vocabulary: keras-hub's
    tokenizer (and TensorFlow, which it imports: ~3 CPU-s a process) waits until it is read."""
    reference = data.tokenizer  # built before counting: this test may be its worker's first
    load, built = tokenizer_module.load_byte_pair, []
    monkeypatch.setattr(tokenizer_module, "load_byte_pair", lambda d: built.append(d) or load(d))
    again = lm_dataset(sequence_length=64, global_batch_size=8, vocabulary_size=1024)
    assert built == [] and again.vocabulary_size == 1024 == data.vocabulary_size
    np.testing.assert_array_equal(again.train[5][0], data.train[5][0])  # the same token store
    assert "tokenizer" not in repr(again)  # a repr builds nothing either
    assert built == []
    tok = again.tokenizer
    assert len(built) == 1 and type(tok) is type(reference)
    assert list(tok.get_vocabulary()) == list(reference.get_vocabulary())
    assert tok.token_to_id(END_OF_TEXT) == data.train.tokens[-1]
    assert again.tokenizer is tok and len(built) == 1  # built once


def test_documents_are_separated_by_end_of_text(data):
    eot = data.tokenizer.token_to_id(END_OF_TEXT)
    stream = data.train.tokens
    assert stream[-1] == eot
    assert np.count_nonzero(np.asarray(stream) == eot) == len(load_corpus().train)
    assert data.train_tokens == len(stream)


def test_batches_are_shifted_windows(data):
    x, y = data.train[3]
    assert x.shape == y.shape == (8, 64) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(10_000)
    a = LMBatches(tokens, 16, 8, seed=1)
    b = LMBatches(tokens, 16, 8, seed=1)
    for step in [5, 0, 100, 3]:  # any order, any step
        np.testing.assert_array_equal(a[step][0], b[step][0])
    assert not np.array_equal(a[0][0], LMBatches(tokens, 16, 8, seed=2)[0][0])
    resumed = LMBatches(tokens, 16, 8, seed=1, start_step=7)
    np.testing.assert_array_equal(resumed[0][0], a[7][0])


def test_each_window_once_per_epoch_and_epochs_differ():
    tokens = np.arange(16 * 64 + 1)  # exactly 64 windows of 16
    ds = LMBatches(tokens, 16, 8, seed=0)
    epoch0 = np.concatenate([ds.windows(s) for s in range(8)])
    epoch1 = np.concatenate([ds.windows(s) for s in range(8, 16)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(64))
    assert not np.array_equal(epoch0, epoch1)


def test_processes_read_disjoint_shares_of_the_global_batch():
    tokens = np.arange(50_000)
    whole = LMBatches(tokens, 32, 12, seed=4)
    shares = [LMBatches(tokens, 32, 12, seed=4, process_index=p, process_count=3)
              for p in range(3)]
    for step in (0, 9):
        parts = [s[step][0] for s in shares]
        assert all(p.shape == (4, 32) for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), whole[step][0])
    with pytest.raises(ValueError, match="does not divide by the 5 processes"):
        LMBatches(tokens, 32, 12, process_count=5)


def test_validation_is_finite_and_in_order(data):
    assert data.validation.num_batches == len(data.validation) > 0
    np.testing.assert_array_equal(data.validation.windows(0), np.arange(8))
    with pytest.raises(IndexError):
        data.validation[len(data.validation)]


def test_segment_ids_count_documents_ended_before_each_position():
    eot = 9
    tokens = np.array([1, 2, eot, 3, eot, eot, 4, 5, 6])
    ds = LMBatches(tokens, 8, 1, shuffle=False, end_of_text_id=eot)
    inputs, targets = ds[0]
    assert inputs["token_ids"].tolist() == [[1, 2, eot, 3, eot, eot, 4, 5]]
    assert inputs["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert targets.tolist() == [[2, eot, 3, eot, eot, 4, 5, 6]]


def test_validation_is_the_whole_split_by_default(data):
    full = (data.validation_tokens - 1) // 64 // 8
    assert data.validation.num_batches == full
    assert data.validation_coverage.startswith(f"the whole validation split: {full} batches")


def test_a_validation_sample_is_strided_over_the_whole_split(data):
    sampled = lm_dataset(sequence_length=64, global_batch_size=8, vocabulary_size=1024,
                         validation_steps=2)
    n = sampled.validation.num_windows
    windows = np.concatenate([sampled.validation.windows(s) for s in range(2)])
    assert windows.tolist() == [i * n // 16 for i in range(16)]  # not the first 16 windows
    assert windows[-1] > 0.9 * n
    assert "2 of the validation split's" in sampled.validation_coverage
    assert "evenly strided over the whole split" in sampled.validation_coverage
    with pytest.raises(ValueError, match="validation_steps must be a positive integer or None"):
        lm_dataset(sequence_length=64, global_batch_size=8, vocabulary_size=1024,
                   validation_steps=0)


def test_strided_windows_are_shared_between_processes():
    tokens = np.arange(1001)  # 100 windows of 10
    whole = LMBatches(tokens, 10, 4, shuffle=False, num_steps=2, spread=True)
    assert [whole.windows(s).tolist() for s in (0, 1)] == [[0, 12, 25, 37], [50, 62, 75, 87]]
    share = LMBatches(tokens, 10, 4, shuffle=False, num_steps=2, spread=True,
                      process_index=1, process_count=2)
    assert share.windows(1).tolist() == [75, 87]
    np.testing.assert_array_equal(whole[0][0][0], tokens[:10])
    np.testing.assert_array_equal(whole[0][0][1], tokens[120:130])
    assert LMBatches(tokens, 10, 4, shuffle=False, num_steps=30,
                     spread=True).windows(0).tolist() == [0, 1, 2, 3]  # covers all: in order


def test_batches_of_given_tokens_can_be_checked_against_the_vocabulary():
    tokens = np.arange(1000) % 300
    LMBatches(tokens, 16, 4, vocabulary_size=300)
    with pytest.raises(ValueError, match=r"LMBatches' tokens has token ids in \[0, 299\] \(first "
                                         r"bad id: 256 at position 256\).*\[0, 256\)"):
        LMBatches(tokens, 16, 4, vocabulary_size=256)
