"""The ``kdist`` command.

    kdist report RUN_DIR [--output PNG]   plot and summarise a run's throughput.jsonl
    kdist report STORE                    a replica-group job's rounds, failures, rejoins
    kdist inspect CKPT_DIR [--read]       list a checkpoint directory's steps, verify them
                                          (a run's directory: the checkpoints below it)
    kdist plan --preset P --mesh M ...     per-device memory, FLOPs, collectives; fits or not
    kdist plan --device tpu-v5e --devices 256 ...   the same for a TPU slice, from this CPU

Subcommands are ``argparse`` subparsers: each has an ``add_<name>_parser`` function that
registers its arguments and the function to run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from kdist import _keras_compat
from kdist.accelerators import NAMES
from kdist.parallel.pipeline.schedules import SCHEDULES
from kdist.planning.target import COMPILERS
from kdist.run_comparison import COMPARISON_PNG, write_comparison
from kdist.run_report import REPORT_PNG, read_rows, trained_tokens, write_report

# === Subcommands ===


def _run_report(args: argparse.Namespace) -> int:
    if len(args.run_dir) > 1:  # several runs: one figure, their validations side by side
        png, text = write_comparison(args.run_dir, args.output)
        print(text)
        print(f"plot: {png}")
        return 0
    run_dir = Path(args.run_dir[0])
    if (run_dir / "manifest.json").is_file() and (run_dir / "rounds").is_dir():
        from kdist.groups.history import job_lines  # a replica store: the job's history

        print("\n".join(job_lines(run_dir)))
        return 0
    groups = sorted(run_dir.glob("group-*/throughput.jsonl"))  # separate group jobs' runs
    for log_dir in [p.parent for p in groups] if groups else [run_dir]:
        png, text = write_report(log_dir, args.output if not groups else None)
        print(text)
        print(f"plot: {png}")
    if groups:  # each group's log counts its share of every batch; the job trained them all
        total = sum(trained_tokens(read_rows(p.parent))[0] for p in groups)
        print(f"all {len(groups)} groups: {total:,} tokens")
    return 0


def add_report_parser(subparsers) -> None:
    """Registers ``kdist report RUN_DIR [RUN_DIR ...] [--output PNG]``."""
    p = subparsers.add_parser("report", help="plot and summarise a run (finished or running), "
                                             "or compare several on one figure",
                              description=write_report.__doc__.split("\n")[0])
    p.add_argument("run_dir", nargs="+",
                   help="the run's log directory (holds throughput.jsonl; with group-*/ "
                        "subdirectories, each group's), or a replica store (python -m "
                        "kdist.launch --replica-store); two or more: their curves on one "
                        "figure and their validation losses against the first's")
    p.add_argument("--output", help=f"PNG path (default RUN_DIR/{REPORT_PNG}; for several "
                                    f"runs, {COMPARISON_PNG} beside the first)")
    p.set_defaults(func=_run_report)


def _run_inspect(args: argparse.Namespace) -> int:
    from kdist.checkpointing import inspect_directory

    text, ok = inspect_directory(args.checkpoint_dir, read_arrays=args.read)
    print(text)
    return 0 if ok else 1


def add_inspect_parser(subparsers) -> None:
    """Registers ``kdist inspect CKPT_DIR [--read]`` (exit status 1 if a step is damaged)."""
    p = subparsers.add_parser("inspect", help="list and verify a checkpoint directory",
                              description="Steps, sizes, losses, model config and mesh of a "
                                          "kdist checkpoint directory; checks the size and "
                                          "SHA-256 of every file of every committed step. "
                                          "Exit status 1 if any is damaged, 2 if there "
                                          "are no checkpoints.")
    p.add_argument("checkpoint_dir", help="the Checkpoint callback's directory, or a "
                                          "directory above it (a run's OUTPUT_DIR)")
    p.add_argument("--read", action="store_true",
                   help="also read every array back (slower)")
    p.set_defaults(func=_run_inspect)
def _run_plan(args: argparse.Namespace) -> int:
    from kdist.accelerators import accelerator
    from kdist.parallel.devices import force_host_devices
    from kdist.planning import mesh_devices, plan

    wanted = args.devices or mesh_devices(args.mesh, 8)
    if args.device is not None:
        device = accelerator(args.device)  # an unknown name is refused before anything starts
        from kdist.precision.peak import fast_peak

        for name, flag in ((args.matmul_precision, "--matmul-precision"),
                           (args.head_matmul_precision, "--head-matmul-precision")):
            if name != "bf16":  # and a precision it has no peak for
                fast_peak(device, name, flag)
    # This machine's devices are compiled on: for a plan of them, or standing in for a
    # named accelerator's (--compile host). A named TPU is compiled for by the TPU compiler
    # (no devices here: kdist.planning.target), else estimated.
    here = args.device is None or args.compile == "host"
    if here and not _keras_compat.jax_backends_started():  # else: the devices there are
        force_host_devices(wanted)  # on CPU; an accelerator's devices are what they are
    devices = None
    if here:
        import jax

        devices = jax.devices()[:wanted]
    overrides = ({"max_sequence_length": args.max_sequence_length}
                 if args.max_sequence_length else {})
    if args.matmul_precision != "bf16":  # the quantized projections are compiled too
        overrides["matmul_precision"] = args.matmul_precision
    if args.head_matmul_precision != "bf16":  # and the quantized head (a task argument)
        _check_head_flag(args.preset)
        overrides["head_matmul_precision"] = args.head_matmul_precision
    overrides = overrides or None
    result = plan(args.preset, mesh=args.mesh, global_batch_size=args.global_batch_size,
                  sequence_length=args.sequence_length, precision=args.precision,
                  remat=False if args.remat in ("auto", "none") else args.remat,
                  grad_accum=args.grad_accum,
                  device_memory=args.device_memory, devices=devices, num_devices=wanted,
                  device=args.device, slices=args.slices, compile=args.compile,
                  verify=not args.no_verify, model_overrides=overrides,
                  context_parallel=args.context_parallel,
                  load_balance=not args.no_load_balance,
                  pipeline_microbatches=args.pipeline_microbatches,
                  pipeline_repeats=args.pipeline_repeats,
                  pipeline_schedule=args.pipeline_schedule, sync_every=args.sync_every,
                  devices_per_host=args.devices_per_host)
    print(result.report())
    if args.matmul_precision != "bf16" or args.head_matmul_precision != "bf16":
        print(_precision_line(args, result, overrides))
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=2, default=str))
        print(f"plan written to {args.json}")
    return 0 if result.fits else 1


def _check_head_flag(preset: str) -> None:
    """``--head-matmul-precision`` is a causal LM task's (``GPTCausalLM``) argument."""
    from kdist.models import task_for_preset
    from kdist.models.base import constructor_arguments

    task = task_for_preset(preset)
    if "head_matmul_precision" not in constructor_arguments(task):
        raise ValueError(f"--head-matmul-precision quantizes a causal LM's vocabulary head "
                         f"(GPTCausalLM); {preset}'s task {task.__name__} has none. Leave "
                         f"it at bf16 for this preset.")


def _precision_line(args, result, overrides) -> str:
    """Which peak a quantized step's MFU divides by (kdist.precision.peak)."""
    from kdist.accelerators import accelerator, for_device_kind, target
    from kdist.planning import cost_model_of
    from kdist.precision.peak import peak_line

    device = (accelerator(args.device) if args.device is not None
              else for_device_kind(target().device_kind))
    if device is None:
        return (f"matmul precision {args.matmul_precision} (head "
                f"{args.head_matmul_precision}): no int8 peak for "
                f"{target().device_kind} (kdist's table holds TPUs and GPUs); pass --device "
                f"(e.g. tpu-v5e) for the peak MFU divides by")
    backbone = {k: v for k, v in (overrides or {}).items() if k != "head_matmul_precision"}
    cost = cost_model_of(args.preset, **backbone)
    return peak_line(device, args.matmul_precision,
                     cost.flops_per_token(result.config["sequence_length"]),
                     args.head_matmul_precision)


def add_plan_parser(subparsers) -> None:
    """Registers ``kdist plan --preset P --mesh M --global-batch-size B ...``."""
    p = subparsers.add_parser(
        "plan", help="per-device memory, FLOPs and collectives of a train step, before running",
        description="Compiles the train step on abstract inputs (no weights allocated) and "
                    "reports per-device memory, FLOPs and collectives, with a verdict and, if "
                    "it does not fit, the smallest change that does. Exit status 1 if it "
                    "does not fit.")
    p.add_argument("--preset", default="gpt-nano",
                   help="a kdist preset of any family, e.g. gpt2-xl, llama-1b, bert-base")
    p.add_argument("--mesh", default="auto", help="e.g. fsdp=8, data=2,model=4, or auto")
    p.add_argument("--matmul-precision", default="bf16",
                   choices=["bf16", "int8", "int8-sr", "fp8"],
                   help="the blocks' projections quantized (kdist.precision); int8 and "
                        "int8-sr: MFU's peak blends the device's int8 and bf16 peaks")
    p.add_argument("--head-matmul-precision", default="bf16",
                   choices=["bf16", "int8", "int8-sr", "fp8"],
                   help="a causal LM's vocabulary head quantized too (GPTCausalLM's "
                        "head_matmul_precision, the recipes' flag): its FLOPs then count at "
                        "the int8 peak as well; bf16 (default): at the bf16 peak")
    p.add_argument("--global-batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--sequence-length", type=int, default=None,
                   help="tokens per sequence (default: the preset's context)")
    p.add_argument("--precision", default="float32",
                   choices=["float32", "f32", "bf16", "bfloat16"])
    p.add_argument("--remat", nargs="?", const="block", default="auto",
                   choices=["auto", "none", "minimal", "save_dots", "block"],
                   help="what each block keeps for the backward pass, as in the recipes "
                        "(auto and none: everything; --remat alone: block)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--pipeline-microbatches", type=int, default=None,
                   help="with a stage axis: microbatches per step (default: one per stage)")
    p.add_argument("--pipeline-repeats", type=int, default=1,
                   help="with a stage axis: circular repeats (stages per device)")
    p.add_argument("--pipeline-schedule", default="auto", choices=["auto", *SCHEDULES],
                   help="with a stage axis: the order of the microbatches' forwards and "
                        "backwards (1f1b, interleaved_1f1b, zero_bubble: at most 2S-2, "
                        "2S-2+(R-1)S chunks, S microbatches in flight instead of M; the report "
                        "draws the timeline and gives the step); auto: gpipe "
                        "if it fits, else 1f1b (the report says why)")
    p.add_argument("--device", default=None,
                   help=f"plan for this accelerator instead of this machine's devices: its "
                        f"HBM, links and slices from kdist's table ({', '.join(NAMES)})")
    p.add_argument("--slices", type=int, default=None,
                   help="with a TPU --device: slices joined by DCN (default: the fewest "
                        "that hold --devices)")
    p.add_argument("--compile", default="auto", choices=list(COMPILERS),
                   help="how the figures are obtained: auto (with --device: the TPU "
                        "compiler ahead of time where libtpu is installed, else an estimate; "
                        "without: compiled here), tpu, host (XLA on this machine's devices, "
                        "standing in) or none (the analytic estimate)")
    p.add_argument("--device-memory", default=None,
                   help="per device, e.g. 80GiB (default: the device's own, or --device's "
                        "HBM)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to plan over (default: the mesh's; 8 for auto)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not compile the suggested change to confirm it")
    p.add_argument("--json", default=None, help="also write the plan as JSON here")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="the model's positions (default: the preset's), for long sequences")
    p.add_argument("--context-parallel", default="all_gather", choices=["all_gather", "ring"],
                   help="attention across a seq axis: all-gather keys/values, or a ring")
    p.add_argument("--no-load-balance", action="store_true",
                   help="seq axis: contiguous token shares instead of balanced causal work")
    p.add_argument("--sync-every", type=int, default=None,
                   help="DiLoCo: steps between syncs of the replica groups (a mesh with a "
                        "replica axis; with --mesh auto, the search gives every mesh one)")
    p.add_argument("--devices-per-host", type=int, default=None,
                   help="devices per host: the plan says which axes cross hosts, and auto "
                        "weighs their bytes (default: this process's devices, one host)")
    p.set_defaults(func=_run_plan)


def command() -> str:
    """How to type the ``kdist`` command in this shell, for the hints printed to a user:
    ``kdist`` where PATH finds this Python's own ``kdist`` script; else that script's path
    (``.venv/bin/kdist`` from the project, its venv not activated); else this Python with
    ``-m kdist``.

    Example:
        >>> command()  # doctest: +SKIP
        '.venv/bin/kdist'
    """
    script = Path(sys.executable).parent / "kdist"
    return as_typed(script) if script.is_file() else f"{as_typed(Path(sys.executable))} -m kdist"


def as_typed(program: Path) -> str:
    """``program`` as a user types it here: its name where PATH finds this very file, else
    its path, relative where it lies below the current directory (a venv's programs,
    links, are never resolved: that would name the system Python).

    Example:
        >>> as_typed(Path(sys.executable))  # doctest: +SKIP
        '.venv/bin/python'
    """
    found = shutil.which(program.name)
    if found is not None and os.path.abspath(found) == os.path.abspath(program):
        return program.name
    relative = os.path.relpath(program)
    return relative if not relative.startswith("..") else os.path.abspath(program)


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
