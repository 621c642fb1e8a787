"""The GPT recipe end to end, small."""

import json
import math
import re
import sys

import pytest

from kdist.cli import command
from tests.helpers import RECIPES

sys.path.insert(0, str(RECIPES))
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
    assert "sample:" in out and f"(plot: {command()} report {tmp_path})" in out
    assert re.findall(r"tok/s: [\d,]+", out) and not re.findall(r"tok/s: [\d,]*\.\d{4}", out)
    assert "validation loss on 2 of the validation split's" in out  # --eval-steps 2: strided
    assert "evenly strided over the whole split" in out
    for name in ("model.keras", "vocabulary.json", "merges.txt", "log.csv", "summary.json"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "summary.json").read_text())["mesh"] == "data=2,fsdp=2,model=2"
    rows = [json.loads(line) for line in (tmp_path / "throughput.jsonl").read_text().splitlines()]
    intervals = [r for r in rows if r["kind"] == "interval"]
    assert [r["step"] for r in intervals] == [4, 8]
    assert intervals[-1]["tokens"] == summary["tokens"] and intervals[-1]["mfu"] > 0


@pytest.mark.slow
def test_a_diloco_run_shorter_than_a_round_saves_what_it_trained(tmp_path, capsys):
    """10 steps on replica=2,data=4 with the default --sync-every (50) ended with the initial
    weights ("validation loss after training: 9.0702 (before: 9.0702)"): no round ended."""
    summary = gpt_pretrain.main(TINY + ["--steps", "10", "--eval-every", "5", "--mesh",
                                        "replica=2,data=4", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "default --sync-every 10 (default with a replica axis" in out
    assert summary["validation_loss_after"] < summary["validation_loss_before"] - 0.5
    assert (tmp_path / "model.keras").exists()


def test_recipe_flags_are_checked_before_work(tmp_path, capsys):
    with pytest.raises(ValueError, match="--steps \\(10\\) must be a multiple of --eval-every"):
        gpt_pretrain.main(["--steps", "10", "--eval-every", "4", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--grad-accum \\(3\\) must be a positive divisor"):
        gpt_pretrain.main(["--grad-accum", "3", "--global-batch-size", "16",
                           "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--mesh fsdp=4: .*describes 4 devices, but 8 are "
                                         "available.* On a CPU, --host-devices N"):
        gpt_pretrain.main(["--mesh", "fsdp=4", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--error-feedback needs --gradient-reduction float8"):
        gpt_pretrain.main(["--gradient-reduction", "bfloat16", "--error-feedback",
                           "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit):  # argparse's: exit status 2
        gpt_pretrain.main(TINY + ["--preset", "gpt-huge", "--output-dir", str(tmp_path)])
    assert "argument --preset: unknown preset 'gpt-huge'" in capsys.readouterr().err


def test_a_python_without_kdist_is_told_how_to_install_it(monkeypatch):
    import importlib.util

    import recipe_flags

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="kdist is not installed.*make setup"):
        recipe_flags.preset("GPT_PRESETS")("gpt-nano")


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


def parse_error(main, argv, capsys) -> str:
    """The error argparse prints for ``argv`` (it exits with status 2 before any work)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: must be a positive integer; got 0. Pass e.g. --steps"),
    (["--steps", "-5"], "argument --steps: must be a positive integer; got -5"),
    (["--steps", "ten"], "argument --steps: expected an integer, got 'ten'"),
    (["--eval-every", "0"], "argument --eval-every: must be a positive integer; got 0"),
    (["--eval-steps", "0"], "argument --eval-steps: must be a positive integer; got 0"),
    (["--learning-rate=-1e-3"], "argument --learning-rate: must be a positive number; got "
                                   "-1e-3. Pass e.g. --learning-rate 0.002"),
    (["--learning-rate", "0"], "argument --learning-rate: must be a positive number; got 0"),
    (["--learning-rate", "nan"], "argument --learning-rate: expected a finite number, got 'nan'. "
                                 "Pass e.g. --learning-rate 0.002"),
    (["--learning-rate", "inf"], "argument --learning-rate: expected a finite number, got 'inf'"),
    (["--warmup-steps", "-1"], "argument --warmup-steps: must be >= 0; got -1"),
    (["--weight-decay", "-0.1"], "argument --weight-decay: must be >= 0; got -0.1"),
    (["--dropout", "1.5"], r"argument --dropout: must be in [0, 1); got 1.5. Pass e.g. "
                           r"--dropout 0.1"),
    (["--dropout", "1"], "argument --dropout: must be in [0, 1); got 1."),
    (["--dropout", "-0.1"], "argument --dropout: must be in [0, 1); got -0.1"),
    (["--grad-accum", "0"], "argument --grad-accum: must be a positive integer; got 0"),
    (["--global-batch-size", "0"], "argument --global-batch-size: must be a positive integer"),
    (["--sequence-length", "-8"], "argument --sequence-length: must be a positive integer"),
    (["--vocabulary-size", "100"], "argument --vocabulary-size: must be at least 258 (256 "
                                   "bytes, end-of-text, a merge); got 100"),
    (["--attention-chunk-size", "0"], "argument --attention-chunk-size: must be a positive"),
    (["--log-every", "0"], "argument --log-every: must be a positive integer; got 0"),
    (["--sample-length", "-1"], "argument --sample-length: must be >= 0; got -1"),
    (["--peak-tflops", "0"], "argument --peak-tflops: must be a positive number; got 0"),
    (["--seed", "-1"], "argument --seed: must be >= 0; got -1"),
    (["--checkpoint-every", "-1"], "argument --checkpoint-every: must be >= 0; got -1"),
    (["--remat", "all"], "argument --remat: invalid choice: 'all' (choose from 'auto', "
         "'none', 'minimal', 'save_dots', 'block')"),
    (["--init-from", "/no/such/checkpoint"], "argument --init-from: /no/such/checkpoint: no such "
                                             "file or directory. Pass an existing checkpoint dir"),
    (["--encoding", "klingon"], "argument --encoding: unknown text encoding 'klingon'. Pass a "
                                "Python codec name, e.g. --encoding utf-8"),
])
def test_bad_flags_fail_at_parsing_naming_the_flag(argv, message, capsys, tmp_path):
    err = parse_error(gpt_pretrain.main, argv + ["--output-dir", str(tmp_path)], capsys)
    assert message in err, err
    assert not any(tmp_path.iterdir())  # nothing was made


def test_flags_wrong_together_fail_before_any_model(tmp_path):
    out = ["--output-dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match="--sequence-length 512 exceeds the 256 positions of "
                                         "--preset gpt-nano. Pass --sequence-length 256 or less"):
        gpt_pretrain.main(["--sequence-length", "512"] + out)
    with pytest.raises(ValueError, match=r"--warmup-steps \(30\) must be less than --steps "
                                         r"\(10\).*Pass e.g. --warmup-steps 2"):
        gpt_pretrain.main(["--steps", "10", "--warmup-steps", "30"] + out)
    assert not (tmp_path / "out").exists()
