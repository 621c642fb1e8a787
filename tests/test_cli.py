"""`kdist report` on a synthetic run log (finished and running)."""

import json

import matplotlib.image
import pytest

from kdist import cli


def write_run(run_dir, steps=30, finished=True):
    rows = [{"kind": "config", "step": 0, "num_devices": 8, "device_kind": "cpu",
             "peak": "0.02 TFLOP/s float32 per device (measured: cpu)",
             "flops_per_token": 1.2e6, "flops_convention": "matmul FLOPs only"}]
    for step in range(10, steps + 1, 10):
        rows.append({"kind": "interval", "step": step, "tokens": step * 4096, "loss": 9 - step / 10,
                     "lr": 1e-3, "tokens_per_s": 2000.0 + step, "tokens_per_s_per_device": 250.0,
                     "examples_per_s": 8.0, "step_time_median_s": 2.0, "step_time_p90_s": 2.2,
                     "tflops_per_device": 0.01, "mfu": 0.5, "compile_s": 5.0, "eval_s": 3.0,
                     "stall_s": 0.0, "elapsed_s": 2.1 * step, "goodput": 0.9,
                     "memory_in_use_bytes": 2**30, "memory_peak_bytes": 2**31,
                     "memory_source": "process_rss"})
        rows.append({"kind": "validation", "step": step, "val_loss": 9.5 - step / 10})
    if finished:
        rows.append({"kind": "end", "step": steps})
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    (run_dir / "throughput.jsonl").write_text(text if finished else text + '{"kind": "inter')


@pytest.mark.parametrize("finished", [True, False])
def test_report_writes_png_and_summary(tmp_path, capsys, finished):
    write_run(tmp_path, finished=finished)
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("finished" if finished else "running") + ", step 30, 122,880 tokens" in out
    assert "MFU 50.0%" in out and "goodput 90.0%" in out and "validation 6.5000" in out
    image = matplotlib.image.imread(tmp_path / "report.png")
    assert image.shape[:2] == (800, 1200) and (image[..., :3] < 0.5).mean() > 0.001


def test_report_explains_a_missing_log(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "No throughput.jsonl" in capsys.readouterr().err


def test_report_says_why_an_mfu_is_missing(tmp_path, capsys):
    write_run(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "throughput.jsonl").read_text().splitlines()]
    for row in rows:
        if row["kind"] == "interval":
            row.update(mfu=None, mfu_unreliable="1.2 TFLOP/s per device exceeds the measured "
                                                "peak 1, which is too low")
    (tmp_path / "throughput.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "MFU not reported (1.2 TFLOP/s per device exceeds" in capsys.readouterr().out


def test_report_plots_each_steps_loss_the_step_0_validation_and_titles_that_fit(tmp_path):
    """The report drew Keras' running epoch mean (a sawtooth dropping at every epoch),
    no point before training, and a peak description wider than its panel."""
    from kdist.run_report import loss_series, read_rows, titles

    write_run(tmp_path)
    rows = read_rows(tmp_path)
    for row in rows:
        if row["kind"] == "interval":
            row["step_losses"] = [[s, 9 - s / 10] for s in range(row["step"] - 9, row["step"] + 1)]
    rows.insert(1, {"kind": "validation", "step": 0, "val_loss": 9.1})
    rows[0]["peak"] = ("0.197 TFLOP/s float32 per device (measured, best of 5 runs "
                       "(unreliable: runs varied 2.3x; load 3.1 on 2 cores): cpu)")
    curves = loss_series(rows)
    assert curves["train"][0] == list(range(1, 31)) and "train_mean" not in curves
    assert curves["validation"][0] == [0, 10, 20, 30]
    names = titles(rows, tmp_path / "a" / "very" / "long" / "run-directory-name")
    assert all(len(line) <= 100 for text in names.values() for line in text.splitlines())
    assert names["figure"].startswith("run run-directory-name:")
    rows = [r for r in read_rows(tmp_path) if r["kind"] != "validation"]  # an older log
    assert loss_series(rows)["train_mean"][0] == [10, 20, 30]


def test_report_names_the_compiled_steps_peak_beside_the_live_memory(tmp_path, capsys):
    write_run(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "throughput.jsonl").read_text().splitlines()]
    for row in rows:
        if row["kind"] == "interval":
            row["compiled_peak_bytes"] = 3 * 2**29
    (tmp_path / "throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["report", str(tmp_path)]) == 0
    assert ("memory: compiled step 1.50 GiB per device (arguments + temporaries + outputs not "
            "aliased + code); live peak 2.00 GiB (process_rss), in use 1.00 GiB"
            in capsys.readouterr().out)
