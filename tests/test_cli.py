"""`kdist report` on a synthetic run log (finished and running)."""

import json
import runpy
import sys

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
    if finished:  # the end record: fit's whole time, the last validation's included
        rows.append({"kind": "end", "step": steps, "tokens": steps * 4096, "elapsed_s": 70.0,
                     "compile_s": 5.0, "eval_s": 12.0, "stall_s": 1.0, "productive_s": 52.0,
                     "goodput": 52 / 70})
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    (run_dir / "throughput.jsonl").write_text(text if finished else text + '{"kind": "inter')


@pytest.mark.parametrize("finished", [True, False])
def test_report_writes_png_and_summary(tmp_path, capsys, finished):
    write_run(tmp_path, finished=finished)
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("finished" if finished else "running") + ", step 30, 122,880 tokens" in out
    assert "MFU 50.0%" in out and "validation 6.5000" in out
    # Finished: the end record's time (the last interval's left the final validation out).
    assert ("evaluation 12.0 s, stalls 1.0 s, goodput 74.3% of 70 s" if finished else
            "evaluation 3.0 s, stalls 0.0 s, goodput 90.0% of 63 s") in out
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


def session(start, stop, killed=False, rate=4096):
    """One fit's rows of a run resumed at ``start``, logged every 5 steps to ``stop`` (with
    ``killed``, no end record: the process died after its last interval)."""
    rows = [{"kind": "config", "step": start, "global_batch_size": 16, "sequence_length": 256},
            {"kind": "validation", "step": start, "val_loss": 9.0 - start / 10}]
    for step in range(start + 5, stop + 1, 5):
        rows.append({"kind": "interval", "step": step, "tokens": (step - start) * rate,
                     "loss": 9.0, "compile_s": 4.0, "eval_s": 0.0,
                     "stall_s": 0.0, "elapsed_s": 10.0 + step - start, "goodput": 0.5,
                     "step_losses": [[s, 9.0 - s / 100 + start] for s in range(step - 4,
                                                                              step + 1)]})
    if not killed:
        rows.append({"kind": "end", "step": stop, "tokens": (stop - start) * rate,
                     "elapsed_s": 20.0, "compile_s": 4.0, "eval_s": 2.0, "stall_s": 0.0,
                     "productive_s": 10.0, "goodput": 0.5})
    return rows


def test_report_spans_a_resumed_run_and_every_groups_tokens(tmp_path, capsys):
    """A run extended from step 10 to 20 reported "step 20, 28,672 tokens" (the last
    process's count) and its loss curve stopped at step 10; a run restarted from an older
    checkpoint must count the steps it trained again once."""
    from kdist.run_report import loss_series, read_rows

    extended = session(0, 10) + session(10, 20)
    (tmp_path / "throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in extended))
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "finished, step 20, 81,920 tokens\n" in out
    assert ("time in fit: compile 8.0 s, evaluation 4.0 s, stalls 0.0 s, goodput 50.0% of "
            "40 s (2 sessions: a resumed or extended run)") in out
    assert loss_series(read_rows(tmp_path))["train"][0] == list(range(1, 21))

    # Killed at step 15 (no end record) after a checkpoint at 10; resumed from 10.
    restarted = session(0, 15, killed=True) + session(10, 20)
    (tmp_path / "throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in restarted))
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("step 20, 81,920 tokens (20,480 more trained, then lost to a restart from an "
            "older checkpoint)") in out
    assert "goodput 50.0% of 45 s" in out  # the killed fit's time up to its last interval
    steps, losses = loss_series(read_rows(tmp_path))["train"]
    assert steps == list(range(1, 21)) and losses[10] == 9.0 - 11 / 100 + 10  # the retrained
    assert loss_series(read_rows(tmp_path))["validation"][0] == [0, 10]

    # Separate replica group jobs: each group's log counts its share of every batch.
    for g in range(2):
        (tmp_path / f"group-{g}").mkdir()
        (tmp_path / f"group-{g}" / "throughput.jsonl").write_text("".join(
            json.dumps(r) + "\n" for r in session(0, 10) + session(10, 20, rate=2048)))
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("step 20, 61,440 tokens") == 2 and "all 2 groups: 122,880 tokens" in out


def test_hints_name_the_kdist_command_as_the_user_can_type_it(tmp_path, monkeypatch, capsys):
    """The recipes ended with "(plot: kdist report ...)", but outside the venv `kdist` is
    not on PATH."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)  # a venv's python: a link, unresolved
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert cli.command() == ".venv/bin/python -m kdist"  # no kdist script there
    (bin_dir / "kdist").write_text("#!/bin/sh\n")
    (bin_dir / "kdist").chmod(0o755)
    assert cli.command() == ".venv/bin/kdist"  # the venv not activated
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cli.command() == str(bin_dir / "kdist")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")  # activated
    assert cli.command() == "kdist"
    # `python -m kdist` is the command.
    monkeypatch.setattr(sys, "argv", ["kdist", "report", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("kdist", run_name="__main__")
    assert exit_.value.code == 2 and "No throughput.jsonl" in capsys.readouterr().err


def test_report_compares_runs_on_one_figure(tmp_path, capsys):
    """Issue 44's bf16-against-int8 plot: two runs' curves on one figure, and each
    validation loss against the first run's at the steps both reached."""
    import json

    for name, shift in (("bf16", 0.0), ("int8", 0.065)):
        (tmp_path / name).mkdir()
        write_run(tmp_path / name)
        rows = [json.loads(line) for line in
                (tmp_path / name / "throughput.jsonl").read_text().splitlines()]
        for row in rows:
            if row["kind"] == "validation":
                row["val_loss"] += shift
        (tmp_path / name / "throughput.jsonl").write_text(
            "\n".join(json.dumps(r) for r in rows) + "\n")
    assert cli.main(["report", str(tmp_path / "bf16"), str(tmp_path / "int8")]) == 0
    out = capsys.readouterr().out
    assert "validation loss (vs bf16):" in out
    # 6.5 at step 30 against 6.565: +1.00 %; every step both validated is a line
    assert "step 30: bf16 6.5000, int8 6.5650 (+1.00 %)" in out
    assert "step 10: bf16 8.5000, int8 8.5650 (+0.76 %)" in out
    image = matplotlib.image.imread(tmp_path / "comparison.png")
    assert image.shape[:2] == (800, 1200) and (image[..., :3] < 0.5).mean() > 0.001
    assert cli.main(["report", str(tmp_path / "bf16"), str(tmp_path / "none")]) == 2
    assert "No throughput.jsonl in" in capsys.readouterr().err
