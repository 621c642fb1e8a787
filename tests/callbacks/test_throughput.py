"""The Throughput callback inside real `fit` runs: rows, token counts, no per-batch syncs."""

import json
import math
import re
from types import SimpleNamespace

import keras
import numpy as np
import pytest

from kdist.callbacks import Throughput, parse_profile_steps, throughput
from kdist.callbacks import peak as peaks
from kdist.callbacks.throughput import JSONL_NAME
from tests.helpers import TINY_GPT, independent_memory, parity_optimizer, tiny_gpt

BATCH, LENGTH = 16, 32  # steps of a few milliseconds: long enough to time


def data(steps, batch=BATCH):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, TINY_GPT["vocabulary_size"], (steps * batch, LENGTH + 1))
    return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")


def rows_of(log_dir, kind):
    rows = [json.loads(line) for line in (log_dir / JSONL_NAME).read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def tensorboard_scalars(path):
    """{(tag, step): value} of the scalar summaries in an event file, read with TensorFlow."""
    import tensorflow as tf

    out, plugins = {}, {}
    for event in tf.compat.v1.train.summary_iterator(str(path)):
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name:  # written with a tag's first value
                plugins[value.tag] = value.metadata.plugin_data.plugin_name
            out[(value.tag, event.step)] = float(tf.make_ndarray(value.tensor))
    assert plugins and set(plugins.values()) == {"scalars"}
    assert {tag for tag, _ in out} == set(plugins)
    return out


def check_intervals(rows, global_batch, steps, log_every):
    assert [r["step"] for r in rows] == list(range(log_every, steps + 1, log_every))
    for i, r in enumerate(rows):
        assert r["tokens"] == global_batch * LENGTH * r["step"]  # exact
        if i == 0 and "tokens_per_s" not in r:
            # The interval holding the compiling step: when Keras' worker threads report
            # its steps in one burst, out of order, they all end by the compiling step's
            # bound (kdist.callbacks.step_clock) and no seconds are theirs — then the row
            # has no rate rather than a made-up one (seen once, 2 cores under load).
            assert r["compile_s"] > 0 and "step_time_median_s" not in r
            continue
        for key in ("tokens_per_s", "tokens_per_s_per_device", "examples_per_s",
                    "tflops_per_device", "step_time_p90_s", "loss",
                    "memory_in_use_bytes", "memory_peak_bytes"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        # Never above 1: a peak measured too low on a busy machine omits MFU, saying why.
        assert 0 < r["mfu"] <= 1 if r["mfu"] is not None else "exceeds" in r["mfu_unreliable"]
        assert r["lr"] >= 0  # warmup starts from 0
        # Millisecond steps can report in bursts (a median of 0); their sum is still exact.
        assert r["step_time_p90_s"] >= r["step_time_median_s"] >= 0
        assert r["examples_per_s"] == pytest.approx(r["tokens_per_s"] / LENGTH)
        assert 0 < r["goodput"] < 1 and r["compile_s"] > 0


def test_fit_writes_exact_rows_with_validation_and_profile(tmp_path):
    model = tiny_gpt()
    model.compile(optimizer=parity_optimizer())
    cb = Throughput(BATCH, LENGTH, log_dir=tmp_path, log_every=4, profile_steps=(3, 4))
    x, y = data(8)
    model.fit(x, y, batch_size=BATCH, epochs=2, validation_data=data(1), verbose=0,
              shuffle=False, callbacks=[cb])
    check_intervals(rows_of(tmp_path, "interval"), BATCH, 16, 4)
    (config,) = rows_of(tmp_path, "config")
    assert config["peak_source"] == "measured" and config["num_devices"] == 1
    assert "causal attention counted as half" in config["flops_convention"]
    assert [r["step"] for r in rows_of(tmp_path, "validation")] == [8, 16]
    (end,) = rows_of(tmp_path, "end")
    assert end["tokens"] == 16 * BATCH * LENGTH and end["eval_s"] > 0
    assert 0 < end["goodput"] < 1
    # Goodput excludes compilation and evaluation.
    assert end["productive_s"] + end["compile_s"] + end["eval_s"] <= end["elapsed_s"]
    # TensorBoard holds the same figures as the JSONL, as scalars-plugin summaries.
    (events,) = (tmp_path / "tensorboard" / "train").glob("events.out.tfevents.*")
    scalars = tensorboard_scalars(events)
    for row in rows_of(tmp_path, "interval"):
        assert scalars[("tokens_per_s", row["step"])] == pytest.approx(row["tokens_per_s"])
        assert scalars[("mfu", row["step"])] == pytest.approx(row["mfu"])
    assert list((tmp_path / "tensorboard" / "plugins" / "profile").rglob("*.xplane.pb"))


@pytest.mark.parametrize("accumulation,steps_per_execution", [(2, 1), (1, 2), (2, 2)])
def test_counts_optimizer_steps_with_accumulation_and_steps_per_execution(
    tmp_path, accumulation, steps_per_execution
):
    # Each fit batch is a micro-batch of BATCH sequences; an optimizer step holds
    # `accumulation` of them.
    model = tiny_gpt()
    model.compile(optimizer=parity_optimizer(gradient_accumulation_steps=accumulation),
                  steps_per_execution=steps_per_execution)
    global_batch = BATCH * accumulation
    # An interval spans four hook calls, so it holds timed steps besides the compiling one.
    log_every = 4 * steps_per_execution // accumulation
    cb = Throughput(global_batch, LENGTH, log_dir=tmp_path, log_every=log_every,
                    peak_tflops=1.0)
    model.fit(*data(16 * accumulation), batch_size=BATCH, verbose=0, shuffle=False,
              callbacks=[cb])
    check_intervals(rows_of(tmp_path, "interval"), global_batch, 16, log_every)
    (config,) = rows_of(tmp_path, "config")
    assert config["peak_source"] == "override"
    assert config["gradient_accumulation_steps"] == accumulation
    assert rows_of(tmp_path, "end")[0]["tokens"] == 16 * global_batch * LENGTH


def test_no_state_sync_per_batch_and_async_dispatch_kept(monkeypatch):
    model = tiny_gpt(mesh="fsdp=8")
    model.compile(optimizer=parity_optimizer())
    syncs = []
    original = model.jax_state_sync
    monkeypatch.setattr(model, "jax_state_sync", lambda: (syncs.append(1), original())[1])
    x, y = data(8)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)  # compiles; baseline count
    baseline, syncs[:] = len(syncs), []
    cb = Throughput(BATCH, LENGTH, log_every=1, peak_tflops=1.0, tensorboard=False)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[cb])
    # One extra sync, in on_train_begin (reading the optimizer), none per batch — the
    # compiled step's memory in every row included.
    assert len(syncs) == baseline + 1
    assert all(r["compiled_peak_bytes"] > 0 for r in cb.rows if r["kind"] == "interval")
    assert [r["step"] for r in cb.rows if r["kind"] == "interval"] == list(range(17, 33))
    assert cb.rows[0]["num_devices"] == 8
    # Keras runs batch-end hooks off the training thread only if every callback allows it.
    assert keras.callbacks.CallbackList([cb])._async_train


def test_reported_stalls_and_argument_errors():
    cb = Throughput(BATCH, LENGTH)
    cb.report_stall(0.25)
    with cb.stall():
        pass
    assert 0.25 <= cb._clock.stall_s < 0.3
    with pytest.raises(ValueError, match="global_batch_size must be a positive int"):
        Throughput(0, LENGTH)
    with pytest.raises(ValueError, match="needs a log_dir"):
        Throughput(BATCH, LENGTH, profile_steps=(1, 2))
    assert parse_profile_steps("3:5") == (3, 5) and parse_profile_steps(None) is None
    with pytest.raises(ValueError, match="'A:B' with 1 <= A <= B"):
        parse_profile_steps("5:3")
    model = tiny_gpt()
    model.compile(optimizer=parity_optimizer(gradient_accumulation_steps=3))
    with pytest.raises(ValueError, match="not divisible by the optimizer's gradient_accum"):
        model.fit(*data(3), batch_size=BATCH, verbose=0, callbacks=[Throughput(16, LENGTH)])


def fake_matmul(seconds):
    """A peak measurement whose runs took ``seconds`` (2 FLOPs per run)."""
    return lambda devices, dtype, repeats: (list(seconds), 2.0)


def test_a_peak_measured_too_low_never_gives_an_mfu_above_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KDIST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peaks, "_load", lambda: 0.0)
    # Start-up on a busy machine: slow, scattered runs (a peak of ~2e-12 TFLOP/s).
    monkeypatch.setattr(peaks, "_time_matmul", fake_matmul([1.0, 2.0, 2.0, 2.0, 3.0]))
    model = tiny_gpt()
    model.compile(optimizer=parity_optimizer())
    cb = Throughput(BATCH, LENGTH, log_dir=tmp_path, log_every=2, tensorboard=False)
    model.fit(*data(4), batch_size=BATCH, verbose=0, shuffle=False, callbacks=[cb])
    (config,) = rows_of(tmp_path, "config")
    assert "measured, best of 5 runs (unreliable: runs varied 2.0x)" in config["peak"]
    assert config["peak_unreliable"] == "runs varied 2.0x"
    intervals = rows_of(tmp_path, "interval")
    assert intervals and all(r["mfu"] is None and "exceeds the measured peak" in
                             r["mfu_unreliable"] for r in intervals)
    assert "mfu" not in cb._progress and cb._progress["tok/s"] > 0  # the progress bar
    # The next start measures again (the figure was unreliable) and keeps the best one;
    # a quiet measurement makes it reliable, and later starts reuse it without measuring.
    monkeypatch.setattr(peaks, "_time_matmul", fake_matmul([1.5] * 5))
    again = peaks.device_peak(cb._local_devices, "float32")
    assert again.tflops == 2e-12 and again.unreliable is None and "10 runs" in again.note
    monkeypatch.setattr(peaks, "_time_matmul", None)  # would fail if called
    assert peaks.device_peak(cb._local_devices, "float32").tflops == 2e-12


def test_a_model_without_cost_model_gets_labelled_6n_flops(tmp_path):
    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = keras.layers.Embedding(TINY_GPT["vocabulary_size"], 16)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(TINY_GPT["vocabulary_size"])(hidden))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
    cb = Throughput(BATCH, LENGTH, log_every=2, peak_tflops=1.0, tensorboard=False)
    model.fit(*data(4), batch_size=BATCH, verbose=0, callbacks=[cb])
    config = cb.rows[0]
    assert config["flops_per_token"] == 6 * model.count_params()
    assert config["flops_convention"].startswith(f"6 x {model.count_params():,} trainable")
    assert config["flops_breakdown"] is None
    mfu = [r["mfu"] for r in cb.rows if "mfu" in r]  # the first interval is compilation
    assert mfu and all(0 < m <= 1 for m in mfu)
    # Any Keras model's step is compiled ahead too: its program's memory is logged.
    peak = independent_memory(model, *(a[:BATCH] for a in data(1))).peak
    assert all(r["compiled_peak_bytes"] == peak for r in cb.rows if r["kind"] == "interval")


def test_the_compiled_steps_peak_is_logged_beside_the_live_memory(tmp_path):
    model = tiny_gpt()
    model.compile(optimizer=parity_optimizer())
    cb = Throughput(BATCH, LENGTH, log_dir=tmp_path, log_every=2, peak_tflops=1.0,
                    tensorboard=False)
    x, y = data(4)
    model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[cb])
    expected = independent_memory(model, x[:BATCH], y[:BATCH])
    intervals = rows_of(tmp_path, "interval")
    assert intervals and all(r["compiled_peak_bytes"] == expected.peak for r in intervals)
    assert intervals[-1]["compiled_memory"] == {
        "argument": expected.argument, "output": expected.output, "alias": expected.alias,
        "temp": expected.temp, "generated_code": expected.generated_code}
    # The live figures stay, labelled as such (on CPU: the process's resident memory).
    assert intervals[-1]["memory_source"] == "process_rss"
    note = rows_of(tmp_path, "config")[0]["memory_note"]
    assert "arguments + temporaries + outputs not aliased + generated code" in note
    assert "live buffers" in note and "compiled_peak_unavailable" not in intervals[-1]


@pytest.mark.parametrize("matmul_precision", ["bf16", "int8"])
def test_mfu_divides_by_the_device_kinds_table_peak_and_names_it(monkeypatch, matmul_precision):
    """On a TPU v5e the denominator is Google's 197 TFLOP/s bf16, named with its source;
    under int8 matmuls the blend of it and the chip's 393 TOP/s int8 by the quantized
    share of the FLOPs (what `kdist plan --matmul-precision int8` divides by). The run is
    on this CPU; only the devices the callback accounts for are v5e chips."""
    from kdist.accelerators import accelerator
    from kdist.precision import peak as blended

    chip = SimpleNamespace(device_kind="TPU v5 lite", platform="tpu", process_index=0,
                           memory_stats=lambda: None)
    monkeypatch.setattr(throughput, "fit_devices", lambda: ([chip], [chip], 0))
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = tiny_gpt(matmul_precision=matmul_precision)
    model.compile(optimizer=parity_optimizer())
    cb = Throughput(BATCH, LENGTH, log_every=2, tensorboard=False)
    model.fit(*data(4), batch_size=BATCH, verbose=0, shuffle=False, callbacks=[cb])
    config = cb.rows[0]
    peak = 197.0
    if matmul_precision == "int8":
        peak = blended.peak_tflops(accelerator("tpu-v5e"), "int8", cb._flops.breakdown)
        assert 197.0 < peak < 393.0
        assert "matmul precision int8" in config["peak"]
    else:
        assert config["peak"] == ("197 TFLOP/s bfloat16 per device (table, tpu-v5e in Google "
                                  "Cloud TPU docs, page 'TPU v5e': TPU v5 lite)")
    assert (config["device_kind"], config["peak_tflops_per_device"], config["peak_source"]) \
        == ("TPU v5 lite", peak, "table")
    timed = [r for r in cb.rows if r.get("tflops_per_device")]
    assert timed and all(r["mfu"] == pytest.approx(r["tflops_per_device"] / peak)
                         for r in timed)


def test_a_measured_peak_says_int8_matmuls_are_counted_at_it():
    from kdist.flops import transformer_flops_per_token

    flops = transformer_flops_per_token(4, 256, 4, 1024, 8192, 256)
    measured = peaks.Peak(0.2, "measured", "cpu", "float32")
    assert peaks.matmul_peak(measured, flops, matmul_precision="bf16") is measured
    said = peaks.matmul_peak(measured, flops, matmul_precision="int8")
    assert said.tflops == 0.2 and "int8 matmuls counted at this float32 peak" in said.note
    fp8 = peaks.matmul_peak(peaks.Peak(197.0, "table", "TPU v5 lite", "bfloat16"), flops,
                            matmul_precision="fp8")
    assert fp8.tflops == 197.0 and "has no fp8 peak" in fp8.note


def test_an_mfu_against_a_peak_measured_under_load_stays_out_of_the_progress_bar(
        tmp_path, monkeypatch, capsys, recwarn):
    """On a loaded CPU the bar showed MFU 0.33-0.87 with no warning (it was in the JSONL
    only): a figure against an unreliable peak is said once, not shown — in a line of its
    own (a UserWarning printed its file and `self._emit_interval(step)` inside the bar) —
    and tokens/s is not shown to 4 decimals (`tok/s: 1503.5000`)."""
    monkeypatch.setenv("KDIST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peaks, "_load", lambda: 0.0)
    # Scattered runs (unreliable) of a peak high enough that MFU stays below 1.
    monkeypatch.setattr(peaks, "_time_matmul", lambda devices, dtype, repeats: (
        [1e-6, 2e-6, 2e-6, 2e-6, 3e-6], 2.0e9))
    model = tiny_gpt()
    model.compile(optimizer=parity_optimizer())
    cb = Throughput(BATCH, LENGTH, log_every=2, tensorboard=False)
    model.fit(*data(4), batch_size=BATCH, verbose=1, shuffle=False, callbacks=[cb])
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "MFU" in line]
    assert len(said) == 1 and said[0].startswith("Throughput: MFU is not shown in the "
                                                 "progress bar: measured peak: runs varied")
    assert not [w for w in recwarn if "MFU" in str(w.message)]
    shown = re.findall(r"tok/s: ([\d,.]+)", out)
    assert shown and not [v for v in shown if re.fullmatch(r"[\d,]*\.\d{4}", v)], shown
    intervals = [r for r in cb.rows if r["kind"] == "interval"]
    assert intervals and all(0 < r["mfu"] < 1 and r["mfu_unreliable"] for r in intervals)
    assert "mfu" not in cb._progress and cb._progress["tok/s"] > 0


def test_each_steps_own_loss_is_logged_and_a_validation_before_fit(tmp_path):
    model = tiny_gpt()
    model.compile(optimizer=parity_optimizer())
    x, y = data(6)
    cb = Throughput(BATCH, LENGTH, log_dir=tmp_path, log_every=2, tensorboard=False)
    cb.record_validation({"loss": 5.5}, step=0)
    per_step = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            per_step.append(logs["loss"])  # Keras' running epoch mean

    model.fit(x, y, batch_size=BATCH, epochs=2, steps_per_epoch=3, verbose=0, shuffle=False,
              callbacks=[cb, Record()])
    first = rows_of(tmp_path, "validation")[0]  # written after the config row
    assert (first["step"], first["val_loss"]) == (0, 5.5)
    losses = [p for r in rows_of(tmp_path, "interval") for p in r["step_losses"]]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]
    # Each epoch's running mean of the logged step losses is what Keras logged.
    for epoch in (0, 1):
        own = [v for _, v in losses[3 * epoch:3 * epoch + 3]]
        means = [sum(own[:k + 1]) / (k + 1) for k in range(3)]
        np.testing.assert_allclose(means, per_step[3 * epoch:3 * epoch + 3], rtol=1e-5)


@pytest.mark.parametrize("scan_layers", [False, True])  # a scanned stack: each layer's row
def test_a_moe_models_expert_load_is_in_each_interval_row_and_the_report(monkeypatch,
                                                                       scan_layers):
    from kdist.models import GPTBackbone, GPTCausalLM
    from kdist.models.moe_load import expert_load
    from kdist.run_report import summarize

    model = GPTCausalLM(GPTBackbone(**dict(TINY_GPT, num_layers=1), scan_layers=scan_layers,
                                    moe={"num_experts": 4, "capacity_factor": 0.5}))
    model.compile(optimizer=parity_optimizer())
    syncs = []
    original = model.jax_state_sync
    monkeypatch.setattr(model, "jax_state_sync", lambda: (syncs.append(1), original())[1])
    x, y = data(4)
    model.fit(x, y, batch_size=BATCH, verbose=0)  # compiles; baseline count
    baseline, syncs[:] = len(syncs), []
    cb = Throughput(BATCH, LENGTH, log_every=2, peak_tflops=1.0, tensorboard=False)
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[cb])
    assert len(syncs) == baseline + 1  # on_train_begin's only: the load is read unsynced
    intervals = [r for r in cb.rows if r["kind"] == "interval"]
    assert [r["step"] for r in intervals] == [6, 8]
    (path,) = expert_load(model)
    for r in intervals:
        load = r["expert_load"][path]
        assert 0 <= load["min_share"] <= 0.25 <= load["max_share"] <= 1
        assert load["dropped_tokens"] > 0 and load["experts"] == 4  # capacity 0.5: drops
    last = {k: v for k, v in intervals[-1]["expert_load"][path].items() if k != "experts"}
    assert last == expert_load(model)[path]  # the last step's, as the synced model has it
    report = summarize(cb.rows)
    assert "expert load (interval ending at step 8" in report and f"  {path}: 4 experts" in report
    dense = [dict(r, expert_load=None) for r in cb.rows]  # a dense run's rows have none
    assert "expert load" not in summarize(dense)
