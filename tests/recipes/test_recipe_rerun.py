"""Running a recipe again: a finished run says so and leaves its outputs alone (a larger
--steps extends it); a resumed run says where it resumes before anything else, and counts
only the tokens it trained."""

import sys

import pytest

from tests.helpers import RECIPES
from tests.recipes.test_recipe_checkpoint import TINY

sys.path.insert(0, str(RECIPES))
import gpt_pretrain  # noqa: E402

OUTPUTS = ("summary.json", "model.keras", "log.csv", "throughput.jsonl")


@pytest.mark.slow
def test_a_finished_run_is_left_alone_and_a_larger_steps_extends_it(tmp_path, capsys):
    out = ["--output-dir", str(tmp_path)]
    first = gpt_pretrain.main(TINY + ["--steps", "2"] + out)
    assert first["tokens"] == 2 * 8 * 32
    before = {name: (tmp_path / name).read_bytes() for name in OUTPUTS}
    capsys.readouterr()

    again = gpt_pretrain.main(TINY + ["--steps", "2", "--mesh", "data=8"] + out)
    printed = capsys.readouterr().out
    assert again["finished"] and again["tokens"] == 0
    assert printed.splitlines()[0].startswith(f"{tmp_path}: this run finished at step 2")
    assert "pass a larger --steps (e.g. --steps 4)" in printed
    assert {name: (tmp_path / name).read_bytes() for name in OUTPUTS} == before

    extended = gpt_pretrain.main(TINY + ["--steps", "4", "--mesh", "data=8"] + out)
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == (f"resuming {tmp_path / 'checkpoints'} at step 2 of 4 "
                                       f"on mesh data=8 (saved on mesh fsdp=8: resharded "
                                       f"as it is read)")
    assert extended["resumed_from_step"] == 2
    assert extended["tokens"] == 2 * 8 * 32  # steps 3-4 only
    assert "512 tokens (steps 3-4)" in printed
