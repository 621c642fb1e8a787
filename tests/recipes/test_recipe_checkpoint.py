"""The GPT recipe's checkpoint flags: a second run resumes where the first stopped."""

import json
import sys

import pytest

from kdist.callbacks import CheckpointError
from kdist.checkpointing import committed_steps, read_metadata
from kdist.run_report import loss_series, read_rows, summarize
from tests.helpers import RECIPES

sys.path.insert(0, str(RECIPES))
import gpt_pretrain  # noqa: E402

TINY = ["--eval-every", "2", "--eval-steps", "1", "--global-batch-size", "8",
        "--sequence-length", "32", "--vocabulary-size", "512", "--warmup-steps", "1",
        "--sample-length", "4", "--log-every", "2", "--checkpoint-every", "2",
        "--preset", "gpt-nano", "--mesh", "fsdp=8",
        "--gradient-reduction", "float32"]  # kdist's reduction, checkpointed and resumed


@pytest.mark.slow
def test_recipe_resumes_from_its_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="resume='required'"):
        gpt_pretrain.main(TINY + ["--steps", "2", "--resume", "--output-dir", str(tmp_path)])
    first = gpt_pretrain.main(TINY + ["--steps", "4", "--output-dir", str(tmp_path)])
    assert first["resumed_from_step"] == 0
    assert committed_steps(tmp_path / "checkpoints") == [2, 4]
    meta = read_metadata(tmp_path / "checkpoints" / "4")
    assert meta["mesh"]["spec"] == "fsdp=8" and meta["data_step"] == 4
    second = gpt_pretrain.main(TINY + ["--steps", "6", "--resume", "--output-dir", str(tmp_path)])
    assert second["resumed_from_step"] == 4
    assert committed_steps(tmp_path / "checkpoints") == [2, 4, 6]
    # The resumed run trained steps 5-6 only: one more epoch of 2 steps in the history.
    assert len(second["history"]["loss"]) == 1
    assert json.loads((tmp_path / "summary.json").read_text())["resumed_from_step"] == 4
    # The report spans both processes: every step's loss, both fits' tokens and time.
    rows = read_rows(tmp_path)
    assert loss_series(rows)["train"][0] == [1, 2, 3, 4, 5, 6]
    ends = [r for r in rows if r["kind"] == "end"]
    report = summarize(rows)
    assert "finished, step 6, 1,536 tokens" in report  # 6 steps x 8 x 32
    assert (f"of {sum(r['elapsed_s'] for r in ends):.0f} s (2 sessions: a resumed or "
            f"extended run)") in report
