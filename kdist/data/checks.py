"""Checks of user data that would otherwise pass silently: token ids, text encodings.

A token id at or above the vocabulary size gives NaN logits and a training loss of exactly
0.0 (the embedding lookup reads past the table); a negative id reads a wrong row and gives
finite, meaningless logits. Neither raises anywhere in Keras or JAX, so kdist checks ids
where they enter: when a token store or a dataset is built (:func:`check_token_ids`,
:func:`check_id_range`), and on NumPy inputs to ``fit``/``predict`` (the models).

Bytes that are not valid in a text file's encoding become U+FFFD when read with
``errors="replace"``; :func:`decode_text` counts them, warns, and refuses a file where
more than ``max_replaced_fraction`` of the bytes were replaced.
"""

from __future__ import annotations

import codecs
import warnings

import numpy as np

# More than this fraction of a file's bytes replaced by U+FFFD: the encoding is wrong.
MAX_REPLACED_FRACTION = 0.001


def _range_error(
    what: str, minimum: int, maximum: int, vocabulary_size: int, where: str = "",
    fix: str | None = None,
) -> ValueError:
    if fix is None:
        if maximum >= vocabulary_size:
            fix = (f"Tokenize with the model's own tokenizer, or build the model with "
                   f"vocabulary_size > {maximum} (e.g. {maximum + 1}).")
        else:
            fix = ("Token ids are never negative: check how the ids were made (a padding "
                   "value of -1, or a signed overflow).")
    return ValueError(
        f"{what} has token ids in [{minimum}, {maximum}]{where}, outside the valid range "
        f"[0, {vocabulary_size}) of its {vocabulary_size}-entry vocabulary. An id >= "
        f"{vocabulary_size} gives NaN logits and a training loss of 0.0; a negative id reads "
        f"a wrong embedding row. {fix}"
    )


def check_id_range(
    minimum: int, maximum: int, vocabulary_size: int, what: str, fix: str | None = None
) -> None:
    """Raise ``ValueError`` unless ``0 <= minimum`` and ``maximum < vocabulary_size``.

    For callers that already know the range of their ids (e.g. a token store's metadata).

    Example:
        >>> check_id_range(0, 99, 100, "the token store")
    """
    if not (0 <= minimum and maximum < vocabulary_size):
        raise _range_error(what, int(minimum), int(maximum), int(vocabulary_size), fix=fix)


def check_token_ids(ids, vocabulary_size: int, what: str) -> None:
    """Raise ``ValueError`` if any of ``ids`` lies outside ``[0, vocabulary_size)``.

    ``ids`` is any integer array (NumPy, list, memmap); one pass over it. The error names
    ``what`` (e.g. ``"fit's x['token_ids']"``), the minimum and maximum found, the position
    of the first offending id, the valid range, and how to fix it. Empty inputs pass.

    Example:
        >>> check_token_ids(np.array([[0, 5, 9]]), 10, "x")
        >>> check_token_ids(np.array([[0, 5, 10]]), 10, "x")
        Traceback (most recent call last):
        ...
        ValueError: x has token ids in [0, 10] (first bad id: 10 at position (0, 2)), ...
    """
    if (isinstance(vocabulary_size, bool) or not isinstance(vocabulary_size, (int, np.integer))
            or vocabulary_size < 1):
        raise ValueError(
            f"vocabulary_size must be a positive integer; got {vocabulary_size!r}."
        )
    ids = np.asarray(ids)
    if ids.size == 0:
        return
    if not np.issubdtype(ids.dtype, np.integer):
        if (np.issubdtype(ids.dtype, np.floating) and np.all(np.isfinite(ids))
                and np.all(ids == np.round(ids))):
            ids = ids.astype(np.int64)
        else:
            raise ValueError(
                f"{what} must hold integer token ids; got dtype {ids.dtype}. Pass integer "
                f"ids (e.g. np.asarray(ids, 'int32'))."
            )
    minimum, maximum = int(ids.min()), int(ids.max())
    if 0 <= minimum and maximum < vocabulary_size:
        return
    position = tuple(int(i) for i in np.argwhere((ids < 0) | (ids >= vocabulary_size))[0])
    shown = str(position[0]) if len(position) == 1 else str(position)
    where = f" (first bad id: {int(ids[position])} at position {shown})"
    raise _range_error(what, minimum, maximum, int(vocabulary_size), where)


def decode_text(
    data: bytes,
    name: str,
    encoding: str = "utf-8",
    max_replaced_fraction: float = MAX_REPLACED_FRACTION,
) -> str:
    """``data`` decoded, with undecodable bytes counted, warned about, and refused above a limit.

    Each byte that is not valid in ``encoding`` becomes U+FFFD. If any were replaced, a
    warning names ``name`` and the count; if more than ``max_replaced_fraction`` of the
    bytes were, a ``ValueError`` names the file and suggests ``--encoding``.

    Example:
        >>> decode_text("café".encode("latin-1") + b" ok" * 1000, "a.txt")  # doctest: +SKIP
        'caf\\ufffd ok ok ...'   (with a warning: 1 byte of a.txt is not valid utf-8)
    """
    try:
        return data.decode(encoding)
    except LookupError:
        raise ValueError(
            f"Unknown text encoding {encoding!r} (--encoding). Use a Python codec name such "
            f"as 'utf-8', 'latin-1' or 'cp1252'."
        ) from None
    except UnicodeDecodeError:
        pass
    # Decode piece by piece with "replace", counting the bytes each error covers.
    replaced = 0
    decoder = codecs.getincrementaldecoder(encoding)(errors="strict")
    pieces, position = [], 0
    while position < len(data):
        try:
            pieces.append(decoder.decode(data[position:], final=True))
            break
        except UnicodeDecodeError as error:
            # error.start/end are relative to the slice passed in.
            pieces.append(data[position:position + error.start].decode(encoding))
            pieces.append("\ufffd" * (error.end - error.start))
            replaced += error.end - error.start
            position += error.end
            decoder.reset()
    text = "".join(pieces)
    fraction = replaced / max(1, len(data))
    if fraction > max_replaced_fraction:
        raise ValueError(
            f"{name}: {replaced:,} of {len(data):,} bytes ({fraction:.2%}) are not valid "
            f"{encoding}, more than the {max_replaced_fraction:.2%} allowed; the file is "
            f"probably in another encoding. Pass its encoding, e.g. --encoding latin-1 "
            f"(encoding='latin-1' in kdist.data), or convert it to UTF-8 "
            f"(iconv -f LATIN1 -t UTF-8)."
        )
    warnings.warn(
        f"{name}: {replaced:,} byte{'s' if replaced != 1 else ''} of {len(data):,} "
        f"{'are' if replaced != 1 else 'is'} not valid {encoding} and became U+FFFD.",
        UnicodeWarning,
        stacklevel=2,
    )
    return text
