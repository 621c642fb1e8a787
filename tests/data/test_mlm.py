"""WordPiece tokenizer, segment packing and dynamic masking for BERT pretraining."""

import random
from pathlib import Path

import numpy as np
import pytest

import kdist.data.wordpiece as wordpiece_module
from kdist.data import MLMBatches, load_corpus, mlm_dataset, pack_segments, word_piece_tokenizer
from kdist.data.corpus import stdlib_files
from kdist.data.wordpiece import CLS, MASK, PAD, SEP

V, T = 1000, 128
CLS_ID, SEP_ID, MASK_ID = 2, 3, 4


def synthetic_packed(rows=512, seed=0):
    """Rows of random tokens 5..V-1 with BERT's layout: [CLS] A [SEP] B [SEP] [PAD]..."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(T // 2, T + 1, rows)
    ids = np.where(np.arange(T) < lengths[:, None], rng.integers(5, V, (rows, T)), 0)
    ids[:, 0] = CLS_ID
    ids[np.arange(rows), lengths // 2] = SEP_ID
    ids[np.arange(rows), lengths - 1] = SEP_ID
    segments = ((np.arange(T) > lengths[:, None] // 2) & (np.arange(T) < lengths[:, None]))
    return {"token_ids": ids.astype(np.uint16), "segment_ids": segments.astype(np.uint8),
            "lengths": lengths.astype(np.int32)}


def batches(packed, **kwargs):
    return MLMBatches(packed, 64, vocabulary_size=V, mask_token_id=MASK_ID,
                      unselectable_token_ids=[0, CLS_ID, SEP_ID], **kwargs)


def five_sigma(p, n):
    """Tolerance for a proportion p estimated from n draws: 5 standard errors (a false
    failure has probability ~6e-7)."""
    return 5 * np.sqrt(p * (1 - p) / n)


def test_masking_statistics_on_a_large_sample():
    packed = synthetic_packed()
    ds = batches(packed, mask_selection_length=T)  # no cap: every selection is kept
    eligible = selected = 0
    outcome = {"mask": 0, "random": 0, "kept": 0}
    for step in range(40):  # 40 x 64 rows, ~240 k eligible tokens, ~36 k selections
        x, y, w = ds[step]
        original = packed["token_ids"][ds.sampler.rows(step)].astype(np.int32)
        real = x["padding_mask"].astype(bool)
        eligible += np.count_nonzero(real & (original != CLS_ID) & (original != SEP_ID))
        used = w > 0
        selected += np.count_nonzero(used)
        rows = np.nonzero(used)[0]
        positions = x["mask_positions"][used]
        # Labels are the original tokens; only eligible tokens are ever selected.
        np.testing.assert_array_equal(y[used], original[rows, positions])
        assert np.isin(original[rows, positions], [0, CLS_ID, SEP_ID]).sum() == 0
        # Tokens that were not selected are untouched.
        untouched = np.ones_like(real)
        untouched[rows, positions] = False
        np.testing.assert_array_equal(x["token_ids"][untouched], original[untouched])
        new = x["token_ids"][rows, positions]
        old = original[rows, positions]
        outcome["mask"] += np.count_nonzero(new == MASK_ID)
        outcome["kept"] += np.count_nonzero(new == old)
        outcome["random"] += np.count_nonzero((new != MASK_ID) & (new != old))
    rate = selected / eligible
    assert abs(rate - 0.15) < five_sigma(0.15, eligible), rate
    # A random replacement is uniform over the V ids: it may hit [MASK] or the original.
    expected = {"mask": 0.8 + 0.1 / V, "random": 0.1 * (1 - 2 / V), "kept": 0.1 + 0.1 / V}
    for kind, p in expected.items():
        share = outcome[kind] / selected
        assert abs(share - p) < five_sigma(p, selected), (kind, share)


def test_masks_are_a_pure_function_of_seed_and_step_and_leave_random_alone():
    packed = synthetic_packed(rows=256)
    a, b = batches(packed, seed=1), batches(packed, seed=1)
    random.seed(123)
    expected_draws = [random.random() for _ in range(3)]
    random.seed(123)
    for step in [5, 0, 9]:  # any order
        x1, y1, w1 = a[step]
        x2, y2, w2 = b[step]
        for key in x1:
            np.testing.assert_array_equal(x1[key], x2[key])
        np.testing.assert_array_equal(y1, y2)
    assert [random.random() for _ in range(3)] == expected_draws  # global state restored
    # Dynamic masking: each row is masked anew in every epoch (4 steps = 1 epoch of 256).
    def masks_by_row(steps):
        return {int(r): tuple(a[s][0]["mask_positions"][i]) for s in steps
                for i, r in enumerate(a.sampler.rows(s))}

    epoch0, epoch1 = masks_by_row(range(4)), masks_by_row(range(4, 8))
    assert sorted(epoch0) == sorted(epoch1) == list(range(256))
    assert sum(epoch0[r] != epoch1[r] for r in epoch0) > 0.95 * 256
    assert not np.array_equal(a[0][0]["mask_positions"], batches(packed, seed=2)[0][0][
        "mask_positions"])
    resumed = batches(packed, seed=1, start_step=7)
    np.testing.assert_array_equal(resumed[0][0]["token_ids"], a[7][0]["token_ids"])


def test_processes_read_disjoint_shares():
    packed = synthetic_packed(rows=256)
    whole = batches(packed, seed=3)
    shares = [batches(packed, seed=3, process_index=p, process_count=4) for p in range(4)]
    rows = np.concatenate([s.sampler.rows(2) for s in shares])
    np.testing.assert_array_equal(rows, whole.sampler.rows(2))
    assert shares[1][2][0]["token_ids"].shape == (16, T)


@pytest.fixture(scope="module")
def tokenizer():
    return word_piece_tokenizer(load_corpus(), vocabulary_size=2048)


def test_word_piece_is_keras_hub_with_the_trained_ids_and_is_cached(tokenizer, monkeypatch):
    import keras_hub
    from tokenizers import BertWordPieceTokenizer

    assert isinstance(tokenizer, keras_hub.tokenizers.WordPieceTokenizer)
    assert [tokenizer.id_to_token(i) for i in range(5)] == [PAD, "[UNK]", CLS, SEP, MASK]
    assert tokenizer.vocabulary_size() == 2048
    # The HF trainer's own encoder and keras-hub's give the same ids on held-out text.
    hf = BertWordPieceTokenizer({t: i for i, t in enumerate(tokenizer.get_vocabulary())},
                                lowercase=False, strip_accents=False, clean_text=True)
    text = load_corpus().validation[0][:4000]
    assert tokenizer.tokenize(text).tolist() == hf.encode(text, add_special_tokens=False).ids
    monkeypatch.setattr(wordpiece_module, "train_word_piece", lambda *a: pytest.fail("retrained"))
    again = word_piece_tokenizer(load_corpus(), vocabulary_size=2048)
    assert again.get_vocabulary() == tokenizer.get_vocabulary()


def test_packing_keeps_lines_in_order_with_bert_layout(tokenizer):
    _, files = stdlib_files()
    documents = [Path(f).read_text() for f in files[:3]]
    packed = pack_segments(documents, tokenizer, sequence_length=64)
    ids, segments, lengths = packed["token_ids"], packed["segment_ids"], packed["lengths"]
    assert ids.shape[1] == 64 and (ids[:, 0] == CLS_ID).all()
    body = []
    for row, seg, n in zip(ids, segments, lengths):
        real = row[:n]
        assert real[-1] == SEP_ID and (row[n:] == 0).all() and (seg[n:] == 0).all()
        seps = np.flatnonzero(real == SEP_ID)
        assert len(seps) in (1, 2)
        # Segment 0 is [CLS] A [SEP]; segment 1 is B [SEP].
        assert (seg[: seps[0] + 1] == 0).all() and (seg[seps[0] + 1 : n] == 1).all()
        body.extend(real[(real != CLS_ID) & (real != SEP_ID)].tolist())
    # The rows hold every line's tokens (a line longer than a row cut to 61), in order.
    lines = [line for d in documents for line in d.splitlines() if line.strip()]
    expected = [t for ids_ in tokenizer.tokenize(lines) for t in np.asarray(ids_)[:61].tolist()]
    assert body == expected
    assert lengths.mean() > 40  # rows are packed, not one line each


def test_mlm_dataset_on_a_local_corpus(tmp_path):
    source = Path(stdlib_files()[0]) / "argparse.py"
    data = mlm_dataset(str(source), sequence_length=64, global_batch_size=8,
                       vocabulary_size=1024, cache_dir=tmp_path)
    x, y, w = data.train[0]
    assert set(x) == {"token_ids", "segment_ids", "padding_mask", "mask_positions"}
    assert x["token_ids"].shape == (8, 64) and x["token_ids"].dtype == np.int32
    assert y.shape == w.shape == (8, data.mask_selection_length) and w.dtype == np.float32
    assert data.vocabulary_size == 1024 and data.validation.num_batches >= 1
    assert len(list(tmp_path.glob("mlm-*.npz"))) == 2  # packed once per split, cached
    with pytest.raises(ValueError, match="global_batch_size=7 is not divisible"):
        import keras

        import kdist
        keras.distribution.set_distribution(kdist.distribution("data=8"))
        mlm_dataset(str(source), global_batch_size=7, cache_dir=tmp_path)



def test_vocabulary_ids_do_not_depend_on_the_trainers_numbering(tmp_path, monkeypatch):
    # Token ids are embedding rows. The HF trainer numbers the tokens it keeps in hash
    # order, which changes from run to run: two identical pretraining runs diverged until
    # vocabulary.txt was written in sorted order. Here the trainer keeps the same tokens
    # under two numberings; the files must be identical.
    from tokenizers import BertWordPieceTokenizer

    tokens = [PAD, "[UNK]", CLS, SEP, MASK, "a", "b", "##b", "def", "##s", "return"]
    numberings = iter([random.Random(seed).sample(range(len(tokens)), len(tokens))
                       for seed in (1, 2)])
    monkeypatch.setattr(BertWordPieceTokenizer, "train_from_iterator", lambda *a, **k: None)
    monkeypatch.setattr(BertWordPieceTokenizer, "get_vocab",
                        lambda self: dict(zip(tokens, next(numberings))))
    files = [tmp_path / f"run{i}" / "vocabulary.txt" for i in range(2)]
    for path in files:
        wordpiece_module.train_word_piece(["a b"], 1024, path)
    assert files[0].read_text() == files[1].read_text()
    assert files[0].read_text().splitlines()[:5] == [PAD, "[UNK]", CLS, SEP, MASK]


def test_a_validation_sample_is_strided_over_all_rows():
    packed = synthetic_packed(rows=512)
    sample = batches(packed, shuffle=False, num_steps=2, spread=True)  # 128 of 512 rows
    rows = np.concatenate([sample.sampler.rows(s) for s in range(2)])
    assert rows.tolist() == list(range(0, 512, 4))
    first = batches(packed, shuffle=False, num_steps=2)
    assert first.sampler.rows(1).tolist() == list(range(64, 128))
    whole = batches(packed, shuffle=False, num_steps=8, spread=True)  # all rows: in order
    assert whole.sampler.rows(7).tolist() == list(range(448, 512))


def test_packing_says_what_it_does_and_shows_progress(tmp_path, capsys):
    """BERT's vocabulary and packing ran 5-6 minutes without a word."""
    from kdist.data.mlm import packed_store

    p = tmp_path / "vocabulary.txt"
    p.write_text("\n".join([PAD, "[UNK]", CLS, SEP, MASK, "a", "b", "c"]))
    tokenizer = wordpiece_module.load_word_piece(p)
    documents = ["a b\nc\n"] * 40
    first = packed_store(documents, tokenizer, 8, tmp_path / "packed.npz")
    out = capsys.readouterr().out
    assert "Packing 40 documents into packed.npz (once; later runs reuse it)" in out
    assert "40/40" in out  # the progress bar's last update
    again = packed_store(documents, tokenizer, 8, tmp_path / "packed.npz")
    assert capsys.readouterr().out == ""  # cached: nothing to say
    assert (first["token_ids"] == again["token_ids"]).all()
