"""No TensorFlow on the training path: ``import kdist`` and a run on token ids load neither
TensorFlow, keras-hub nor TFDS; the text pipeline and TFDS import them when used, and a
missing one is an ImportError naming the extra to install."""

import json
import subprocess
import sys
import types

import numpy as np
import pytest

from kdist._optional import optional_import
from kdist.data import load_word_piece
from kdist.data.sources import text_source
from kdist.data.tokenizer import byte_pair_tokenizer, train_byte_pair
from kdist.data.wordpiece import SPECIAL_TOKENS, word_piece_tokenizer
from tests.helpers import ROOT, child_environment, tiny_gpt

SCRIPT = ROOT / "tests" / "token_ids_script.py"


def test_import_kdist_loads_no_tensorflow_keras_hub_or_tfds():
    """In a fresh process, so this process's own imports do not count."""
    code = ("import json, sys, kdist; print(json.dumps(sorted(m for m in sys.modules "
            "if m.startswith(('tensorflow', 'keras_hub', 'tensorboard')))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_environment(), timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert loaded == [] and "tensorflow_datasets" not in loaded


@pytest.mark.parametrize("tensorflow", ["not-installed", "installed"])
def test_a_run_on_token_ids_needs_none_of_them(tmp_path, tensorflow):
    """A token store and numpy ids, fit with Throughput (TensorBoard on) and Checkpoint, a
    .keras round trip of a rotary GPT. Not installed (a core install): it all works and
    none is loaded. Installed: none is loaded either — Keras' own LazyModule imported
    TensorFlow in every get_config and set_random_seed (5-8 s a process) until kdist made
    it ask only once TensorFlow is loaded (kdist._keras_compat.tensorflow_only_when_loaded)."""
    args = [sys.executable, str(SCRIPT), str(tmp_path)]
    done = subprocess.run(args + (["--not-installed"] if tensorflow == "not-installed" else []),
                          capture_output=True, text=True, env=child_environment(),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.splitlines()[-1])
    assert run["optional_after_import_kdist"] == []
    assert run["checkpoint_steps"] == [2, 4] and run["keras_round_trip_equal"]
    assert run["event_files"] == ["log/tensorboard/train", "numpy-log/tensorboard/train"]
    assert len(run["losses"]) == 2 and all(np.isfinite(run["losses"]))
    importers = {name: file for name, file in run["import_attempts"]}
    assert run["optional_after_run"] == []
    assert not any(f.startswith(str(ROOT / "kdist")) for f in importers.values()), importers


@pytest.mark.parametrize("blocked,extra,use", [
    ("keras_hub", "text", lambda tmp: load_word_piece(vocabulary(tmp))),
    ("tokenizers", "text", lambda tmp: train_byte_pair(["a b"], 512, tmp / "bpe")),
    ("tensorflow_datasets", "tfds", lambda tmp: text_source("tfds:tiny_shakespeare")),
    ("keras_hub", "text",
     lambda tmp: tiny_gpt().generate(np.zeros((1, 2), "int32"), 4, sampler="greedy")),
])
def test_a_missing_package_names_its_extra_where_it_is_used(tmp_path, monkeypatch, blocked,
                                                            extra, use):
    # sys.modules[name] = None: Python's own "not installed" (import raises
    # ModuleNotFoundError); kdist has imported everything else already.
    monkeypatch.setitem(sys.modules, blocked, None)
    with pytest.raises(ImportError, match=rf"pip install 'kdist\[{extra}\]'") as caught:
        use(tmp_path)
    message = str(caught.value)
    assert f"'{blocked.replace('_', '-')}' package" in message  # what is missing
    assert "training on token ids needs neither it nor TensorFlow" in message
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)  # the import's own error


@pytest.mark.parametrize("make", [byte_pair_tokenizer, word_piece_tokenizer])
def test_a_tokenizer_is_refused_before_it_trains(tmp_path, monkeypatch, capsys, make):
    """Not after "Training a ... vocabulary" and seconds of training."""
    monkeypatch.setitem(sys.modules, "keras_hub", None)
    corpus = types.SimpleNamespace(fingerprint="f", train=["def f(x):\n    return x\n"])
    with pytest.raises(ImportError, match=r"pip install 'kdist\[text\]'"):
        make(corpus, 1024, tmp_path)
    assert "Training" not in capsys.readouterr().out and not list(tmp_path.iterdir())


def vocabulary(directory):
    path = directory / "vocabulary.txt"
    path.write_text("\n".join([*SPECIAL_TOKENS, "a", "b"]))
    return path


def test_only_known_optional_modules_are_imported_this_way():
    with pytest.raises(ValueError, match="not one of kdist's optional dependencies"):
        optional_import("numpy", "Anything")
    assert optional_import("keras_hub", "A test") is sys.modules["keras_hub"]
