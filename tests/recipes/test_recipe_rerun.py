"""Running a recipe again: a finished run says so and leaves its outputs alone (a larger
--steps extends it); a resumed run says where it resumes before anything else, and counts
only the tokens it trains. (`make run ARGS="--mesh fsdp=8"` after `make run` resumed at step
200 of 200, trained nothing, printed "819,200 tokens" and replaced summary.json and
model.keras.) The checkpoint directories here are only what the recipe reads before it
builds anything: a committed step's kdist.json."""

import json
import sys

import pytest

from kdist.callbacks import CheckpointError
from tests.helpers import RECIPES
from tests.recipes.test_recipe_checkpoint import TINY

sys.path.insert(0, str(RECIPES))
import gpt_pretrain  # noqa: E402
import recipe_run  # noqa: E402

OUTPUTS = {"summary.json": "{}", "model.keras": "weights", "log.csv": "epoch"}


def committed(output_dir, step: int, mesh: str = "fsdp=8"):
    step_dir = output_dir / "checkpoints" / str(step)
    step_dir.mkdir(parents=True)
    (step_dir / "kdist.json").write_text(json.dumps({"step": step, "mesh": {"spec": mesh}}))
    for name, text in OUTPUTS.items():
        (output_dir / name).write_text(text)


def test_a_finished_run_trains_nothing_and_leaves_its_outputs_alone(tmp_path, capsys):
    committed(tmp_path, 4)
    summary = gpt_pretrain.main(TINY + ["--steps", "4", "--mesh", "data=8",
                                        "--output-dir", str(tmp_path)])
    printed = capsys.readouterr().out.splitlines()
    assert summary["finished"] and summary["tokens"] == 0
    assert printed == [f"{tmp_path}: this run finished at step 4 (checkpoint {tmp_path}/"
                       f"checkpoints/4), so there is nothing to train and its outputs are left "
                       f"as they are. To train it further pass a larger --steps (e.g. --steps "
                       f"8); for a new run pass another --output-dir."]
    assert {n: (tmp_path / n).read_text() for n in OUTPUTS} == OUTPUTS


def test_a_resumed_run_says_where_it_resumes_first(tmp_path, capsys):
    committed(tmp_path, 2)  # of 4: a larger --steps extends a finished run the same way
    with pytest.raises(CheckpointError, match="No intact checkpoint"):  # a stand-in step
        gpt_pretrain.main(TINY + ["--steps", "4", "--mesh", "data=8",
                                  "--output-dir", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[0] == (
        f"resuming {tmp_path / 'checkpoints'} at step 2 of 4 on mesh data=8 (saved on mesh "
        f"fsdp=8: resharded as it is read)")


def test_the_token_count_is_this_runs():
    args = gpt_pretrain.parse_args(["--steps", "200", "--global-batch-size", "16",
                                    "--sequence-length", "256"])
    assert recipe_run.trained_tokens(args, 0) == 819_200
    assert recipe_run.trained_tokens(args, 150) == 50 * 16 * 256
