"""The GPT recipe under a pipeline mesh, alone and composed with context parallelism and
DiLoCo groups: only --mesh (and --sync-every) changes, and it learns."""

import re
import sys

import pytest

from tests.helpers import RECIPES

sys.path.insert(0, str(RECIPES))
import gpt_pretrain  # noqa: E402

from tests.recipes.test_recipe import TINY  # noqa: E402


@pytest.mark.slow
def test_recipe_learns_under_stage_4_fsdp_2(tmp_path, capsys):
    summary = gpt_pretrain.main(TINY + ["--mesh", "stage=4,fsdp=2", "--output-dir",
                                        str(tmp_path)])
    out = capsys.readouterr().out
    assert summary["mesh"] == "stage=4,fsdp=2"
    assert summary["validation_loss_after"] < summary["validation_loss_before"] - 0.5
    assert "sample:" in out and (tmp_path / "model.keras").exists()
    # The schedule the planner chose, its microbatches (one per stage by default; 8 rows over
    # fsdp=2) and bubble: GPipe's 3 / (4 + 3); 1F1B's ticks idle 44 % of its cells.
    assert re.search(r"^pipeline: (gpipe|1f1b) over stage=4, 4 microbatches of 1 sequence per "
                     r"batch shard; bubble (43|44)% of the devices' time$", out, re.M), out


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ["--mesh", "stage=2,seq=2,fsdp=2", "--context-parallel", "ring"],
    ["--mesh", "replica=2,stage=2,seq=2", "--sync-every", "4"],
], ids=["stage-seq-fsdp", "replica-stage-seq"])
def test_recipe_learns_on_composed_axes(flags, tmp_path):
    summary = gpt_pretrain.main(TINY + flags + ["--output-dir", str(tmp_path)])
    assert sorted(summary["mesh"].split(",")) == sorted(flags[1].split(","))
    assert summary["validation_loss_after"] < summary["validation_loss_before"] - 0.5
    assert (tmp_path / "model.keras").exists()


def test_pipeline_flags_are_checked_before_work(tmp_path):
    with pytest.raises(ValueError, match="fewer than the 4 pipeline stages"):
        gpt_pretrain.main(["--mesh", "stage=4,fsdp=2", "--pipeline-microbatches", "2",
                           "--output-dir", str(tmp_path)])
