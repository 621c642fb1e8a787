"""Argument types shared by the recipes: a bad flag fails at parsing, naming the flag.

Each function returns an ``argparse`` ``type=`` callable; argparse prefixes its error with
``argument --flag:``, and the message repeats the flag in its fix, so a user sees what was
wrong, what is expected and what to type, before any model is built or compiled.

    p.add_argument("--steps", type=positive_int("--steps", example=200), default=200)
"""

from __future__ import annotations

import argparse
import codecs
import glob
import importlib.util
import math
from pathlib import Path


def _integer(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, got {text!r}. Pass a whole number, e.g. {flag} 10."
        ) from None


def _number(flag: str, text: str, example: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number, got {text!r}. Pass e.g. {flag} {example}."
        ) from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"expected a finite number, got {text!r}. Pass e.g. {flag} {example}."
        )
    return value


def positive_int(flag: str, example: int = 1, what: str = ""):
    """An integer >= 1."""

    def parse(text: str) -> int:
        value = _integer(flag, text)
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"must be a positive integer{' (' + what + ')' if what else ''}; got {value}. "
                f"Pass e.g. {flag} {example}."
            )
        return value

    return parse


def nonnegative_int(flag: str, example: int = 0, what: str = ""):
    """An integer >= 0."""

    def parse(text: str) -> int:
        value = _integer(flag, text)
        if value < 0:
            raise argparse.ArgumentTypeError(
                f"must be >= 0{' (' + what + ')' if what else ''}; got {value}. "
                f"Pass e.g. {flag} {example}."
            )
        return value

    return parse


def int_at_least(flag: str, minimum: int, what: str = ""):
    """An integer >= ``minimum``."""

    def parse(text: str) -> int:
        value = _integer(flag, text)
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be at least {minimum}{' (' + what + ')' if what else ''}; got {value}. "
                f"Pass e.g. {flag} {minimum}."
            )
        return value

    return parse


def positive_float(flag: str, example: float):
    """A finite number > 0 (not NaN, not inf)."""

    def parse(text: str) -> float:
        value = _number(flag, text, example)
        if value <= 0:
            raise argparse.ArgumentTypeError(
                f"must be a positive number; got {text}. Pass e.g. {flag} {example}."
            )
        return value

    return parse


def nonnegative_float(flag: str, example: float):
    """A finite number >= 0."""

    def parse(text: str) -> float:
        value = _number(flag, text, example)
        if value < 0:
            raise argparse.ArgumentTypeError(
                f"must be >= 0; got {text}. Pass e.g. {flag} {example}."
            )
        return value

    return parse


def probability(flag: str, example: float, zero: bool = True, what: str = ""):
    """A number in [0, 1) (``zero=True``, e.g. a dropout rate) or in (0, 1)."""
    interval = "[0, 1)" if zero else "(0, 1)"

    def parse(text: str) -> float:
        value = _number(flag, text, example)
        if not ((0 <= value if zero else 0 < value) and value < 1):
            raise argparse.ArgumentTypeError(
                f"must be in {interval}{' (' + what + ')' if what else ''}; got {text}. "
                f"Pass e.g. {flag} {example}."
            )
        return value

    return parse


def existing_path(flag: str, what: str = "file or directory"):
    """A path that exists (``~`` expanded); returned as given (a string)."""

    def parse(text: str) -> str:
        if not Path(text).expanduser().exists():
            raise argparse.ArgumentTypeError(
                f"{text}: no such file or directory. Pass an existing {what} to {flag}, or "
                f"leave {flag} out."
            )
        return text

    return parse


def preset(table: str):
    """A preset name of ``kdist.models.presets``' ``table`` (``"GPT_PRESETS"``,
    ``"BERT_PRESETS"``), checked by reading that file of kdist's (plain data) alone: no
    kdist, JAX or Keras is imported for it."""

    def parse(text: str) -> str:
        kdist = importlib.util.find_spec("kdist")  # where it is; nothing is imported
        if kdist is None:
            raise SystemExit("kdist is not installed in this Python. Run `make setup` and use "
                             ".venv/bin/python (or `pip install -e .`), then run the recipe "
                             "again.")
        path = Path(kdist.origin).parent / "models" / "presets.py"
        spec = importlib.util.spec_from_file_location("_kdist_presets", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        names = getattr(module, table)
        if text not in names:
            raise argparse.ArgumentTypeError(
                f"unknown preset {text!r}. Pass one of: {', '.join(names)}.")
        return text

    return parse


def text_data(flag: str = "--data"):
    """``python-stdlib`` (the embedded corpus), ``tfds:NAME``, or local text: an existing
    file or directory, or a glob that matches something (what kdist.data.text_source
    takes), checked at parsing."""

    def parse(text: str) -> str:
        if text == "python-stdlib" or (text.startswith("tfds:") and len(text) > 5):
            return text
        path = str(Path(text).expanduser())
        if Path(path).exists() or glob.glob(path, recursive=True):
            return text
        raise argparse.ArgumentTypeError(
            f"{text!r} is no file, directory or glob with matches. Pass local text "
            f"({flag} corpus.txt, {flag} 'corpus/*.txt'), {flag} python-stdlib (the embedded "
            f"corpus) or {flag} tfds:NAME.")

    return parse


def text_encoding(flag: str = "--encoding"):
    """A Python codec name (``utf-8``, ``latin-1``, ``cp1252``...)."""

    def parse(text: str) -> str:
        try:
            return codecs.lookup(text).name
        except LookupError:
            raise argparse.ArgumentTypeError(
                f"unknown text encoding {text!r}. Pass a Python codec name, e.g. {flag} utf-8 "
                f"or {flag} latin-1."
            ) from None

    return parse


def check_warmup(args) -> None:
    """--warmup-steps below --steps, else the learning rate never reaches its peak."""
    if args.warmup_steps >= args.steps:
        raise ValueError(f"--warmup-steps ({args.warmup_steps}) must be less than --steps "
                         f"({args.steps}), or the learning rate never reaches "
                         f"--learning-rate. Pass e.g. --warmup-steps {args.steps // 10}.")


def check_sequence_length(args, max_sequence_length: int, where: str) -> None:
    """--sequence-length within the positions of the model (``where`` names it)."""
    if args.sequence_length > max_sequence_length:
        raise ValueError(f"--sequence-length {args.sequence_length} exceeds the "
                         f"{max_sequence_length} positions of {where}. Pass "
                         f"--sequence-length {max_sequence_length} or less.")
