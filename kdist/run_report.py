"""A run's report: read its ``throughput.jsonl``, summarise it in a few lines, plot it.

``kdist report RUN_DIR`` (:mod:`kdist.cli`) calls :func:`write_report`; it works on a
finished or a running run (a half-written last line is skipped).

A resumed or extended run appends to the same file: each ``fit`` (a **session**) starts
with a ``config`` row at the step it resumed from and ends with an ``end`` row. The report
spans them all: tokens and time are summed over the sessions (each session's own figures
from its ``end`` row, or its last interval if it was killed or is still going), and where
a session restarted from a checkpoint older than the previous session's last step, the
steps trained again replace the ones lost (they are counted apart, not twice).

Example:
    >>> print(summarize([{"kind": "config", "step": 0, "num_devices": 1}]))  # doctest: +ELLIPSIS
    run : running, step 0, 0 tokens
    ...
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import textwrap
from pathlib import Path
from typing import Any

from kdist.callbacks.expert_load import load_lines
from kdist.callbacks.throughput import JSONL_NAME
from kdist.groups.history import round_lines
from kdist.planning.units import format_bytes

REPORT_PNG = "report.png"


def read_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``RUN_DIR/throughput.jsonl``; a half-written last line is skipped.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "throughput.jsonl").write_text('{"kind": "config", "step": 0}\\n{"ki')
        >>> read_rows(d)
        [{'kind': 'config', 'step': 0}]
    """
    path = Path(run_dir) / JSONL_NAME
    if not path.is_file():
        raise ValueError(f"No {JSONL_NAME} in {run_dir}. Pass the log_dir of a run trained "
                         f"with kdist.callbacks.Throughput (the recipes' --output-dir).")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a running run may be mid-write
    return rows


@dataclasses.dataclass
class Session:
    """One ``fit`` of a run (one process that trained it): its rows from its ``config`` row
    on. ``start``: the optimizer step it resumed from; ``last``: the step of its last row
    that counts tokens (``end``, else its last interval); ``tokens``: its own count there."""

    rows: list[dict[str, Any]]

    @property
    def start(self) -> int:
        first = self.rows[0]
        return first.get("step", 0) if first.get("kind") == "config" else 0

    @property
    def counted(self) -> dict[str, Any]:
        return next((r for r in reversed(self.rows) if r.get("tokens") is not None), {})

    @property
    def last(self) -> int:
        return self.counted.get("step", self.start)

    @property
    def tokens(self) -> int:
        return self.counted.get("tokens", 0)

    def times(self) -> dict[str, Any]:
        """Its time figures: the ``end`` row's over its last interval's (a killed or
        running session has no ``end`` row)."""
        last = next((r for r in reversed(self.rows) if r.get("kind") == "interval"), {})
        end = next((r for r in self.rows if r.get("kind") == "end"), {})
        return {**last, **end}


def sessions(rows: list[dict[str, Any]]) -> list[Session]:
    """The run's sessions in order: a new one at every ``config`` row (rows before the
    first, from a log written before config rows existed, form one of their own).

    Example:
        >>> [s.start for s in sessions([{"kind": "config", "step": 0},
        ...                             {"kind": "config", "step": 20}])]
        [0, 20]
    """
    out: list[Session] = []
    for row in rows:
        if row.get("kind") == "config" or not out:
            out.append(Session([]))
        out[-1].rows.append(row)
    return out


def trained_tokens(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """``(tokens, retrained)``: the tokens behind the run's newest step, over every session,
    and the tokens trained then lost to a restart from an older checkpoint (trained again,
    so counted once in ``tokens``).

    Example:
        >>> trained_tokens([{"kind": "config", "step": 0}, {"kind": "end", "step": 15,
        ...     "tokens": 150}, {"kind": "config", "step": 10}, {"kind": "end", "step": 20,
        ...     "tokens": 100}])
        (200, 50)
    """
    kept: list[tuple[int, int, float]] = []  # (from step, to step, tokens per step)
    retrained = 0.0
    for s in sessions(rows):
        rate = s.tokens / (s.last - s.start) if s.last > s.start else 0.0
        retrained += sum(r * (b - max(a, s.start)) for a, b, r in kept if b > s.start)
        kept = [(a, min(b, s.start), r) for a, b, r in kept if a < s.start]
        kept.append((s.start, s.last, rate))
    return round(sum(r * (b - a) for a, b, r in kept)), round(retrained)


def series(rows, kind, key):
    """``(steps, values)`` of ``key`` in the rows of ``kind``, over every session: where a
    session restarted from an older step, the earlier sessions' points past it are dropped
    (those steps were trained again), and a step logged twice keeps the later value."""
    return _after_restarts(rows, lambda r: [(r["step"], r[key])] if r.get("kind") == kind
                           and r.get(key) is not None else [])


def _after_restarts(rows, points):
    found: dict[int, Any] = {}
    for s in sessions(rows):
        found = {step: v for step, v in found.items() if step <= s.start}
        for row in s.rows:
            found.update(points(row))
    steps = sorted(found)
    return steps, [found[step] for step in steps]


def summarize(rows: list[dict[str, Any]], run_dir: str | Path = "") -> str:
    """A few lines about a run: where it is, throughput, MFU, goodput, losses, memory.

    Throughput figures are medians over the last (up to) five intervals; where they report
    no MFU (its peak was too low to trust), the line says why instead. Tokens and time span
    every session of a resumed or extended run (:func:`trained_tokens`); time is what the
    sessions' ``fit`` calls took, from each one's ``end`` row.

    Example:
        >>> text = summarize([{"kind": "config", "step": 0, "num_devices": 1}])
        >>> print(text)  # doctest: +ELLIPSIS
        run ...: running, step 0, 0 tokens
        ...
    """
    parts = sessions(rows) or [Session([])]
    current = parts[-1].rows
    config = current[0] if current and current[0].get("kind") == "config" else {}
    finished = any(r.get("kind") == "end" for r in current)
    intervals = [r for r in rows if r.get("kind") == "interval"]
    recent = [r for r in intervals if r.get("tokens_per_s") is not None][-5:]
    last = intervals[-1] if intervals else {}
    step = max((r.get("step", 0) for r in current), default=0)
    tokens, retrained = trained_tokens(rows)

    def median(key):
        values = [r[key] for r in recent if r.get(key) is not None]
        return statistics.median(values) if values else None

    lines = [f"run {run_dir}: {'finished' if finished else 'running'}, step {step}, "
             f"{tokens:,} tokens"
             + (f" ({retrained:,} more trained, then lost to a restart from an older "
                f"checkpoint)" if retrained else "")]
    if config:
        lines.append(f"devices: {config.get('num_devices')} x {config.get('device_kind')}, "
                     f"peak {config.get('peak')}")
        lines.append(f"FLOPs: {config.get('flops_per_token', 0):.4g} per token; "
                     f"{config.get('flops_convention')}")
    if recent:
        mfu = median("mfu")
        unreliable = next((r["mfu_unreliable"] for r in reversed(recent)
                           if r.get("mfu_unreliable")), None)
        line = (f"throughput: {median('tokens_per_s'):,.0f} tokens/s "
                f"({median('tokens_per_s_per_device'):,.0f} per device), "
                f"{median('examples_per_s'):,.2f} examples/s, "
                f"step {median('step_time_median_s'):.3f} s median / "
                f"{median('step_time_p90_s'):.3f} s p90, "
                f"{median('tflops_per_device'):.3g} TFLOP/s per device, "
                + (f"MFU {mfu:.1%}" if mfu is not None else "MFU not reported"))
        if median("hfu") is not None:
            line += f", HFU {median('hfu'):.1%} (remat)"
        if unreliable:
            line += f" ({unreliable})"
        lines.append(line)
    if last:
        lines.append(_time_line(parts))
        memory = last.get("memory_peak_bytes")
        compiled = last.get("compiled_peak_bytes")
        if memory is not None or compiled is not None:
            line = "memory: "
            if compiled is not None:  # kdist.callbacks.step_memory
                line += (f"compiled step {format_bytes(compiled)} per device (arguments + "
                         f"temporaries + outputs not aliased + code); ")
            if memory is not None:
                line += (f"live peak {memory / 2**30:.2f} GiB ({last.get('memory_source')}), "
                         f"in use {last.get('memory_in_use_bytes', 0) / 2**30:.2f} GiB")
            lines.append(line.rstrip("; "))
    lines += _process_lines(intervals) + round_lines(rows) + load_lines(intervals)
    _, train = series(rows, "interval", "loss")
    _, val = series(rows, "validation", "val_loss")
    if train or val:
        parts = []
        if train:
            parts.append(f"train {train[-1]:.4f}")
        if val:
            parts.append(f"validation {val[-1]:.4f} (best {min(val):.4f})")
        lines.append("loss: " + ", ".join(parts))
    return "\n".join(lines)


def _time_line(parts: list[Session]) -> str:
    """Compile, evaluation, stalls and goodput summed over the sessions' ``fit`` calls
    (time outside ``fit``, such as a recipe's validation before training, is in none).

    Example:
        >>> print(_time_line(sessions([{"kind": "config", "step": 0}, {"kind": "end",
        ...     "step": 4, "elapsed_s": 10.0, "compile_s": 2.0, "eval_s": 1.0,
        ...     "stall_s": 0.0, "productive_s": 7.0, "goodput": 0.7}])))
        time in fit: compile 2.0 s, evaluation 1.0 s, stalls 0.0 s, goodput 70.0% of 10 s
    """
    total = dict.fromkeys(("compile_s", "eval_s", "stall_s", "elapsed_s", "productive_s"), 0.0)
    spans = 0
    for s in parts:
        t = s.times()
        if t.get("elapsed_s") is None:
            continue
        spans += 1
        for key in ("compile_s", "eval_s", "stall_s", "elapsed_s"):
            total[key] += t.get(key) or 0.0
        productive = t.get("productive_s")  # an interval row has the share only
        total["productive_s"] += (productive if productive is not None
                                  else (t.get("goodput") or 0.0) * t["elapsed_s"])
    goodput = total["productive_s"] / total["elapsed_s"] if total["elapsed_s"] else 0.0
    return (f"time in fit: compile {total['compile_s']:.1f} s, evaluation "
            f"{total['eval_s']:.1f} s, stalls {total['stall_s']:.1f} s, goodput {goodput:.1%} "
            f"of {total['elapsed_s']:.0f} s"
            + (f" ({spans} sessions: a resumed or extended run)" if spans > 1 else ""))


def _process_lines(intervals: list[dict[str, Any]]) -> list[str]:
    """One line per process of a multi-process run (the last interval that has them),
    stragglers marked, and when each was first named.

    Example:
        >>> for line in _process_lines([{"step": 4, "processes_step": 2, "stragglers": [1],
        ...     "processes": [{"process": 0, "step_time_median_s": 0.5, "input_wait_s": 0.01},
        ...                   {"process": 1, "step_time_median_s": 0.5, "input_wait_s": 0.4}]}]):
        ...     print(line)
        processes (interval ending at step 2):
          process 0: step 0.500 s median, input wait 0.010 s per step
          process 1: step 0.500 s median, input wait 0.400 s per step  STRAGGLER (named at step 4)
    """
    rows = [r for r in intervals if r.get("processes")]
    if not rows:
        return []
    named = {}
    for r in rows:
        for p in r.get("stragglers") or ():
            named.setdefault(p, r["step"])
    last = rows[-1]
    out = [f"processes (interval ending at step {last.get('processes_step')}):"]
    for p in last["processes"]:
        step, wait = p.get("step_time_median_s"), p.get("input_wait_s")
        line = (f"  process {p['process']}: step "
                + (f"{step:.3f} s median" if step is not None else "not timed")
                + (f", input wait {wait:.3f} s per step" if wait is not None else ""))
        if p["process"] in (last.get("stragglers") or ()):
            line += f"  STRAGGLER (named at step {named[p['process']]})"
        out.append(line)
    return out


def loss_series(rows: list[dict[str, Any]]) -> dict[str, tuple[list, list]]:
    """The report's loss curves: ``"train"``, each step's own loss (the intervals'
    ``step_losses``; logs written before kdist recorded them fall back to Keras' running
    epoch mean, ``"train_mean"``), and ``"validation"``, with the step-0 point a recipe
    records before training.

    Example:
        >>> loss_series([{"kind": "interval", "step": 2, "loss": 3.5,
        ...               "step_losses": [[1, 4.0], [2, 3.0]]},
        ...              {"kind": "validation", "step": 0, "val_loss": 4.2}])["train"]
        ([1, 2], [4.0, 3.0])
    """
    train = _after_restarts(rows, lambda r: [tuple(p) for p in r.get("step_losses") or ()]
                            if r.get("kind") == "interval" else [])
    out = {"train": train}
    if not train[0]:
        out["train_mean"] = series(rows, "interval", "loss")
    out["validation"] = series(rows, "validation", "val_loss")
    return out


def titles(rows: list[dict[str, Any]], run_dir: str | Path) -> dict[str, str]:
    """The figure's titles, each short enough for its panel (the peak's long description
    wrapped under the MFU panel's title; the run named by its directory)."""
    configs = [r for r in rows if r.get("kind") == "config"]
    peak = str(configs[-1].get("peak", "")) if configs else ""
    text = summarize(rows, Path(run_dir).name or str(run_dir)).splitlines()[0]
    return {"figure": textwrap.shorten(text, 100, placeholder=" ..."),
            "mfu": "MFU" + ("\n" + textwrap.fill(f"peak {peak}", 60) if peak else "")}


def write_report(run_dir: str | Path, output: str | Path | None = None) -> tuple[Path, str]:
    """Plots a run into a PNG (loss per step with the validations, tokens/s, MFU, step time
    against step) and summarises it. Works on a finished or a running run. Returns the
    PNG's path and the summary text.

    Example:
        >>> png, text = write_report("runs/gpt_pretrain")  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = read_rows(run_dir)
    output = Path(output) if output else Path(run_dir) / REPORT_PNG
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    (loss_ax, tps_ax), (mfu_ax, time_ax) = axes
    names = titles(rows, run_dir)

    losses = loss_series(rows)
    if "train_mean" in losses:
        loss_ax.plot(*losses["train_mean"], label="train (running epoch mean)")
    else:
        loss_ax.plot(*losses["train"], linewidth=0.8, label="train (each step)")
    loss_ax.plot(*losses["validation"], "o-", label="validation")
    loss_ax.set(title="loss", xlabel="step", ylabel="loss")
    loss_ax.legend()

    tps_ax.plot(*series(rows, "interval", "tokens_per_s"))
    tps_ax.set(title="throughput", xlabel="step", ylabel="tokens / s (global)")

    mfu_ax.plot(*series(rows, "interval", "mfu"), label="MFU")
    steps, hfu = series(rows, "interval", "hfu")
    if hfu:
        mfu_ax.plot(steps, hfu, "--", label="HFU (with remat recompute)")
    mfu_ax.set(xlabel="step", ylabel="model FLOPs utilisation")
    mfu_ax.set_title(names["mfu"], fontsize=9)
    mfu_ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    mfu_ax.legend()

    time_ax.plot(*series(rows, "interval", "step_time_median_s"), label="median")
    time_ax.plot(*series(rows, "interval", "step_time_p90_s"), label="p90")
    time_ax.set(title="step time (per optimizer step)", xlabel="step", ylabel="seconds")
    time_ax.legend()

    text = summarize(rows, run_dir)
    fig.suptitle(names["figure"], fontsize=10)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output, text
