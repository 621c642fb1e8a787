"""A recipe answers ``--help`` and a bad flag at once: its flags are parsed and checked
before TensorFlow, JAX and Keras load (that took 35 s to minutes on a loaded machine), and
``--help`` shows every default."""

import subprocess
import sys
import time

import pytest

from tests.helpers import RECIPES, child_environment

RECIPE_FILES = ["gpt_pretrain.py", "bert_pretrain.py", "bert_finetune.py", "gpt_finetune.py"]
HEAVY = ("jax", "keras", "tensorflow", "kdist", "numpy")


def run(*argv) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          env=child_environment(), timeout=120, cwd=RECIPES.parent)
    return done, time.perf_counter() - start


@pytest.mark.parametrize("recipe", RECIPE_FILES)
def test_help_and_a_bad_flag_answer_in_under_3_s(recipe):
    shown, seconds = run(str(RECIPES / recipe), "--help")
    assert shown.returncode == 0 and seconds < 3, (seconds, shown.stderr[-2000:])
    assert "(default: auto)" in shown.stdout  # --mesh: every default is printed
    assert "--checkpoint-every" in shown.stdout and "--sync-every" in shown.stdout
    bad, seconds = run(str(RECIPES / recipe), "--steps", "x")
    assert bad.returncode == 2 and seconds < 3, (seconds, bad.stderr[-2000:])
    assert "argument --steps: expected an integer, got 'x'" in bad.stderr


def test_parsing_and_checking_the_flags_imports_nothing_heavy():
    code = ("import sys; sys.path.insert(0, 'recipes'); import gpt_pretrain, recipe_options; "
            "args = gpt_pretrain.parse_args(['--steps', '20']); "
            "recipe_options.settle_defaults(args); recipe_options.check_together(args); "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    done, _ = run("-c", code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("recipe", ["gpt_pretrain.py", "bert_pretrain.py", "bert_finetune.py"])
def test_an_unknown_preset_is_refused_at_parsing(recipe):
    bad, seconds = run(str(RECIPES / recipe), "--preset", "gpt-nanoo")
    assert bad.returncode == 2 and seconds < 3, (seconds, bad.stderr[-2000:])
    assert "argument --preset: unknown preset 'gpt-nanoo'. Pass one of: " in bad.stderr


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "data=3"], "--mesh data=3: Mesh spec 'data=3' describes 3 devices, but 8 "),
    (["--mesh", "data=8", "--global-batch-size", "12"],
     "--global-batch-size 12 does not split over the 8 batch shards of --mesh data=8 "
     "(replica x data x fsdp). Use a --global-batch-size that is a multiple of 8, e.g. 8 or 16."),
], ids=["mesh", "batch"])
def test_a_setting_refused_once_the_devices_are_known_is_one_line(tmp_path, flags, message):
    done, _ = run(str(RECIPES / "gpt_pretrain.py"), "--host-devices", "8", "--steps", "2",
                  "--output-dir", str(tmp_path / "run"), *flags)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"gpt_pretrain.py: error: {message}" in done.stderr
    assert "Traceback" not in done.stderr
    assert "validation loss" not in done.stdout  # refused before the data and the model


@pytest.mark.parametrize("recipe", ["gpt_pretrain.py", "bert_pretrain.py", "gpt_finetune.py"])
def test_text_that_is_not_there_is_refused_at_parsing(recipe):
    bad, seconds = run(str(RECIPES / recipe), "--data", "/nonexistent/corpus-*.txt")
    assert bad.returncode == 2 and seconds < 3, (seconds, bad.stderr[-2000:])
    assert ("argument --data: '/nonexistent/corpus-*.txt' is no file, directory or glob with "
            "matches. Pass local text (--data corpus.txt") in bad.stderr
