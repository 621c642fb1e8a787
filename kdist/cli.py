"""The ``kdist`` command.

    kdist report RUN_DIR [--output PNG]   plot and summarise a run's throughput.jsonl
    kdist inspect CKPT_DIR [--read]       list a checkpoint directory's steps, verify them
    kdist plan --preset P --mesh M ...     per-device memory, FLOPs, collectives; fits or not

Subcommands are ``argparse`` subparsers: each has an ``add_<name>_parser`` function that
registers its arguments and the function to run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from kdist.callbacks.throughput import JSONL_NAME

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


def _series(rows, kind, key):
    pairs = [(r["step"], r[key]) for r in rows if r.get("kind") == kind and r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def summarize(rows: list[dict[str, Any]], run_dir: str | Path = "") -> str:
    """A few lines about a run: where it is, throughput, MFU, goodput, losses, memory.

    Figures are medians over the last (up to) five intervals.

    Example:
        >>> text = summarize([{"kind": "config", "step": 0, "num_devices": 1}])
        >>> print(text)  # doctest: +ELLIPSIS
        run ...: running, step 0, 0 tokens
        ...
    """
    configs = [i for i, r in enumerate(rows) if r.get("kind") == "config"]
    config = rows[configs[-1]] if configs else {}
    current = rows[configs[-1]:] if configs else rows
    finished = any(r.get("kind") == "end" for r in current)
    intervals = [r for r in rows if r.get("kind") == "interval"]
    recent = [r for r in intervals if r.get("tokens_per_s") is not None][-5:]
    last = intervals[-1] if intervals else {}
    step = max((r.get("step", 0) for r in rows), default=0)

    def median(key):
        values = [r[key] for r in recent if r.get(key) is not None]
        return statistics.median(values) if values else None

    lines = [f"run {run_dir}: {'finished' if finished else 'running'}, step {step}, "
             f"{last.get('tokens', 0):,} tokens"]
    if config:
        lines.append(f"devices: {config.get('num_devices')} x {config.get('device_kind')}, "
                     f"peak {config.get('peak')}")
        lines.append(f"FLOPs: {config.get('flops_per_token', 0):.4g} per token; "
                     f"{config.get('flops_convention')}")
    if recent:
        line = (f"throughput: {median('tokens_per_s'):,.0f} tokens/s "
                f"({median('tokens_per_s_per_device'):,.0f} per device), "
                f"{median('examples_per_s'):,.2f} examples/s, "
                f"step {median('step_time_median_s'):.3f} s median / "
                f"{median('step_time_p90_s'):.3f} s p90, "
                f"{median('tflops_per_device'):.3g} TFLOP/s per device, "
                f"MFU {median('mfu'):.1%}")
        if median("hfu") is not None:
            line += f", HFU {median('hfu'):.1%} (remat)"
        lines.append(line)
    if last:
        lines.append(f"time: compile {last.get('compile_s') or 0:.1f} s, evaluation "
                     f"{last.get('eval_s') or 0:.1f} s, stalls {last.get('stall_s') or 0:.1f} s, "
                     f"goodput {last.get('goodput') or 0:.1%} of "
                     f"{last.get('elapsed_s') or 0:.0f} s")
        memory = last.get("memory_peak_bytes")
        if memory is not None:
            lines.append(f"memory: peak {memory / 2**30:.2f} GiB "
                         f"({last.get('memory_source')}), in use "
                         f"{last.get('memory_in_use_bytes', 0) / 2**30:.2f} GiB")
    _, train = _series(rows, "interval", "loss")
    _, val = _series(rows, "validation", "val_loss")
    if train or val:
        parts = []
        if train:
            parts.append(f"train {train[-1]:.4f}")
        if val:
            parts.append(f"validation {val[-1]:.4f} (best {min(val):.4f})")
        lines.append("loss: " + ", ".join(parts))
    return "\n".join(lines)


def write_report(run_dir: str | Path, output: str | Path | None = None) -> tuple[Path, str]:
    """Plots a run into a PNG (loss, tokens/s, MFU, step time against step) and summarises it.

    Works on a finished or a running run. Returns the PNG's path and the summary text.

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

    loss_ax.plot(*_series(rows, "interval", "loss"), label="train (running epoch mean)")
    loss_ax.plot(*_series(rows, "validation", "val_loss"), "o-", label="validation")
    loss_ax.set(title="loss", xlabel="step", ylabel="loss")
    loss_ax.legend()

    tps_ax.plot(*_series(rows, "interval", "tokens_per_s"))
    tps_ax.set(title="throughput", xlabel="step", ylabel="tokens / s (global)")

    mfu_ax.plot(*_series(rows, "interval", "mfu"), label="MFU")
    steps, hfu = _series(rows, "interval", "hfu")
    if hfu:
        mfu_ax.plot(steps, hfu, "--", label="HFU (with remat recompute)")
    configs = [r for r in rows if r.get("kind") == "config"]
    peak = configs[-1].get("peak", "") if configs else ""
    mfu_ax.set(title=f"MFU (peak {peak})", xlabel="step", ylabel="model FLOPs utilisation")
    mfu_ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    mfu_ax.legend()

    time_ax.plot(*_series(rows, "interval", "step_time_median_s"), label="median")
    time_ax.plot(*_series(rows, "interval", "step_time_p90_s"), label="p90")
    time_ax.set(title="step time (per optimizer step)", xlabel="step", ylabel="seconds")
    time_ax.legend()

    text = summarize(rows, run_dir)
    fig.suptitle(text.splitlines()[0], fontsize=10)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output, text


# === Subcommands ===


def _run_report(args: argparse.Namespace) -> int:
    png, text = write_report(args.run_dir, args.output)
    print(text)
    print(f"plot: {png}")
    return 0


def add_report_parser(subparsers) -> None:
    """Registers ``kdist report RUN_DIR [--output PNG]``."""
    p = subparsers.add_parser("report", help="plot and summarise a run (finished or running)",
                              description=write_report.__doc__.split("\n")[0])
    p.add_argument("run_dir", help="the run's log directory (holds throughput.jsonl)")
    p.add_argument("--output", help=f"PNG path (default RUN_DIR/{REPORT_PNG})")
    p.set_defaults(func=_run_report)


def _run_inspect(args: argparse.Namespace) -> int:
    from kdist.callbacks.checkpoint import inspect_directory

    text, ok = inspect_directory(args.checkpoint_dir, read_arrays=args.read)
    print(text)
    return 0 if ok else 1


def add_inspect_parser(subparsers) -> None:
    """Registers ``kdist inspect CKPT_DIR [--read]`` (exit status 1 if a step is damaged)."""
    p = subparsers.add_parser("inspect", help="list and verify a checkpoint directory",
                              description="Steps, sizes, losses, model config and mesh of a "
                                          "kdist checkpoint directory; checks every file of "
                                          "every committed step. Exit status 1 if any is "
                                          "damaged.")
    p.add_argument("checkpoint_dir", help="the Checkpoint callback's directory")
    p.add_argument("--read", action="store_true",
                   help="also read every array back (slower; catches corrupt contents)")
    p.set_defaults(func=_run_inspect)
def _run_plan(args: argparse.Namespace) -> int:
    from kdist.plan import _mesh_devices, plan

    wanted = args.devices or _mesh_devices(args.mesh, 8)
    _force_host_devices(wanted)
    import jax

    result = plan(args.preset, mesh=args.mesh, global_batch_size=args.global_batch_size,
                  sequence_length=args.sequence_length, precision=args.precision,
                  remat=args.remat == "block", grad_accum=args.grad_accum,
                  device_memory=args.device_memory, devices=jax.devices()[:wanted],
                  verify=not args.no_verify)
    print(result.report())
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2, default=str))
        print(f"plan written to {args.json}")
    return 0 if result.fits else 1


def _force_host_devices(count: int) -> None:
    """On CPU, ask XLA for ``count`` host devices, if jax has not started its backends yet."""
    import os
    import re

    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count={count}"
                               + ("" if "multi_thread_eigen" in flags
                                  else " --xla_cpu_multi_thread_eigen=false")).strip()


def add_plan_parser(subparsers) -> None:
    """Registers ``kdist plan --preset P --mesh M --global-batch-size B ...``."""
    p = subparsers.add_parser(
        "plan", help="per-device memory, FLOPs and collectives of a train step, before running",
        description="Compiles the train step on abstract inputs (no weights allocated) and "
                    "reports per-device memory, FLOPs and collectives, with a verdict and, if "
                    "it does not fit, the smallest change that does. Exit status 1 if it "
                    "does not fit.")
    p.add_argument("--preset", default="gpt-nano", help="a kdist GPT preset, e.g. gpt2-xl")
    p.add_argument("--mesh", default="auto", help="e.g. fsdp=8, data=2,model=4, or auto")
    p.add_argument("--global-batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--sequence-length", type=int, default=None,
                   help="tokens per sequence (default: the preset's context)")
    p.add_argument("--precision", default="float32",
                   choices=["float32", "f32", "bf16", "bfloat16"])
    p.add_argument("--remat", default="none", choices=["none", "block"])
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--device-memory", default=None,
                   help="per device, e.g. 80GiB (default: the device's own)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to plan over (default: the mesh's; 8 for auto)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not compile the suggested change to confirm it")
    p.add_argument("--json", default=None, help="also write the plan as JSON here")
    p.set_defaults(func=_run_plan)


def build_parser() -> argparse.ArgumentParser:
    """The ``kdist`` argument parser with every subcommand.

    Example:
        >>> build_parser().parse_args(["report", "runs/x"]).run_dir
        'runs/x'
    """
    parser = argparse.ArgumentParser(prog="kdist", description="kdist command-line tools")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_report_parser(subparsers)
    add_inspect_parser(subparsers)
    add_plan_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kdist`` command; returns the exit status.

    Example:
        >>> main(["report", "runs/gpt_pretrain"])  # doctest: +SKIP
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kdist {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
