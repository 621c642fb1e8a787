"""The checks of user data that would otherwise pass silently: token ids, text encodings."""

import numpy as np
import pytest

from kdist.data.checks import check_id_range, check_token_ids, decode_text


def test_ids_inside_the_vocabulary_pass():
    check_token_ids(np.array([[0, 5, 9]]), 10, "x")
    check_token_ids(np.zeros((0, 4), np.int32), 10, "x")  # empty
    check_token_ids(np.array([1.0, 2.0]), 10, "x")  # whole floats are ids
    check_id_range(0, 9, 10, "the store")


@pytest.mark.parametrize("ids, found, first", [
    (np.array([[0, 5, 10]]), r"\[0, 10\]", r"first bad id: 10 at position \(0, 2\)"),
    (np.array([3, -1, 2]), r"\[-1, 3\]", "first bad id: -1 at position 1"),
    (np.array([[1, 2], [3, 70_000]], np.uint32), r"\[1, 70000\]",
     r"first bad id: 70000 at position \(1, 1\)"),
])
def test_ids_outside_the_vocabulary_name_what_where_and_the_range(ids, found, first):
    with pytest.raises(ValueError, match=f"fit's x has token ids in {found} \\({first}\\), "
                                         r"outside the valid range \[0, 10\)") as error:
        check_token_ids(ids, 10, "fit's x")
    assert "NaN logits" in str(error.value)


def test_the_fix_depends_on_the_side():
    with pytest.raises(ValueError, match=r"vocabulary_size > 12 \(e.g. 13\)"):
        check_token_ids([12], 10, "x")
    with pytest.raises(ValueError, match="never negative"):
        check_id_range(-1, 3, 10, "x")
    with pytest.raises(ValueError, match="delete it"):
        check_id_range(0, 10, 10, "x", fix="delete it")


def test_non_integer_ids_and_bad_vocabulary_sizes_are_refused():
    with pytest.raises(ValueError, match="must hold integer token ids; got dtype float"):
        check_token_ids(np.array([0.5]), 10, "x")
    with pytest.raises(ValueError, match="must hold integer token ids"):
        check_token_ids(np.array([np.nan]), 10, "x")
    for size in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="vocabulary_size must be a positive integer"):
            check_token_ids([0], size, "x")


def test_decoding_counts_warns_and_refuses_replaced_bytes():
    assert decode_text("héllo".encode(), "a.txt") == "héllo"
    text = "café".encode("latin-1") + b" plain ascii" * 200  # 1 bad byte of 2,404
    with pytest.warns(UnicodeWarning, match="a.txt: 1 byte of 2,404 is not valid utf-8"):
        assert decode_text(text, "a.txt") == "caf\ufffd" + " plain ascii" * 200
    latin = "déjà vu, à côté, naïve, élève ".encode("latin-1") * 10
    with pytest.raises(ValueError, match=r"b.txt: 80 of 300 bytes \(26.67%\) are not valid utf-8"
                                         r".*--encoding latin-1"):
        decode_text(latin, "b.txt")
    assert decode_text(latin, "b.txt", "latin-1") == "déjà vu, à côté, naïve, élève " * 10
    with pytest.raises(ValueError, match="Unknown text encoding 'klingon'.*--encoding"):
        decode_text(b"x", "c.txt", "klingon")
