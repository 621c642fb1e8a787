"""The GPT recipe end to end, small."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import gpt_pretrain  # noqa: E402

TINY = ["--steps", "8", "--eval-every", "4", "--eval-steps", "2", "--global-batch-size", "8",
        "--sequence-length", "64", "--vocabulary-size", "1024", "--warmup-steps", "2",
        "--learning-rate", "3e-3", "--sample-length", "8", "--log-every", "4"]


@pytest.mark.slow
def test_recipe_runs_and_learns(tmp_path, capsys):
    summary = gpt_pretrain.main(TINY + ["--mesh", "data=2,fsdp=2,model=2",
                                        "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert summary["validation_loss_after"] < summary["validation_loss_before"] - 0.5
    assert abs(summary["validation_loss_before"] - math.log(1024)) < 0.5
    assert summary["tokens"] == 8 * 8 * 64
    assert "sample:" in out and "outputs written to" in out
    for name in ("model.keras", "vocabulary.json", "merges.txt", "log.csv", "summary.json"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "summary.json").read_text())["mesh"] == "data=2,fsdp=2,model=2"
    rows = [json.loads(line) for line in (tmp_path / "throughput.jsonl").read_text().splitlines()]
    intervals = [r for r in rows if r["kind"] == "interval"]
    assert [r["step"] for r in intervals] == [4, 8]
    assert intervals[-1]["tokens"] == summary["tokens"] and intervals[-1]["mfu"] > 0


def test_recipe_flags_are_checked_before_work(tmp_path):
    with pytest.raises(ValueError, match="--steps \\(10\\) must be a multiple of --eval-every"):
        gpt_pretrain.main(["--steps", "10", "--eval-every", "4", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--grad-accum \\(3\\) must be a positive divisor"):
        gpt_pretrain.main(["--grad-accum", "3", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="describes 4 devices, but 8 are available"):
        gpt_pretrain.main(["--mesh", "fsdp=4", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="gradient_reduction='bfloat16' covers the data"):
        gpt_pretrain.main(["--gradient-reduction", "bfloat16", "--mesh", "fsdp=4,model=2",
                           "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="Unknown preset"):
        gpt_pretrain.main(TINY + ["--preset", "gpt-huge", "--output-dir", str(tmp_path)])


@pytest.mark.slow
def test_recipe_with_gradient_accumulation(tmp_path):
    summary = gpt_pretrain.main(TINY + ["--grad-accum", "2", "--mesh", "fsdp=4,model=2",
                                        "--output-dir", str(tmp_path)])
    assert summary["tokens"] == 8 * 8 * 64
    assert summary["validation_loss_after"] < summary["validation_loss_before"]


@pytest.mark.slow
def test_recipe_llama_with_document_mask_and_chunked_attention(tmp_path):
    summary = gpt_pretrain.main(TINY + ["--preset", "llama-nano", "--document-mask",
                                        "--attention-chunk-size", "16",
                                        "--mesh", "fsdp=4,model=2",
                                        "--output-dir", str(tmp_path)])
    assert summary["validation_loss_after"] < summary["validation_loss_before"] - 0.5
