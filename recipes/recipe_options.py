"""The flags every recipe shares, and the defaults that adapt to what the user typed.

Only ``argparse`` and the standard library are imported here: ``--help`` and a bad flag are
answered before TensorFlow, JAX or Keras load (``tests/recipes/test_recipe_startup.py``).

Four groups, one spelling in every recipe (``tests/recipes/test_recipe_options.py``):

* ``add_mesh_flags``: the mesh and every parallelism feature of ``kdist.distribution``.
* ``add_schedule_flags``: steps, batch, learning rate, warmup, validation, accumulation.
* ``add_run_flags``: precision, remat, seed, logs, output directory.
* ``add_checkpoint_flags``: checkpoints, resuming, extending a finished run.

:func:`command` runs a recipe's ``main``: what is refused while the run is set up is one
line naming the flag, as argparse's own errors are.

A default that depends on another flag is ``None`` in the parser and is chosen by
:func:`settle_defaults` once every flag is known; each choice comes back as a line for the
log. A value the user typed is never changed, only refused when it cannot work.

    p = recipe_parser(__doc__)
    add_schedule_flags(p, steps=200, learning_rate=2e-3, warmup_steps=30, eval_every=50)
    args = p.parse_args(["--steps", "20"])
    settle_defaults(args)   # ['--warmup-steps 4 (default: min(30, --steps // 5))']
"""

from __future__ import annotations

import argparse
import os
import sys

from recipe_flags import (
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    probability,
    text_data,
    text_encoding,
)

# Whether the run is still being set up (flags, devices, mesh, data, model): cleared by
# recipe_run.fit_callbacks once the checkpoint is restored, just before training.
setting_up = True

# kdist.models.remat's policies ("none": False); `kdist plan --remat` takes the same.
REMAT_CHOICES = ("auto", "none", "minimal", "save_dots", "block")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
    """Prints every flag's default, and the recipe's docstring as written."""


def recipe_parser(doc: str) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` whose ``--help`` shows the docstring and every default.

    Example:
        >>> recipe_parser("Pretrain.\\n\\nMore.").description.splitlines()[0]
        'Pretrain.'
    """
    return argparse.ArgumentParser(description=doc, formatter_class=_HelpFormatter)


def add_shared_flags(p: argparse.ArgumentParser, *, output_dir: str, log_every: int,
                     causal_lm: bool = False, **schedule) -> None:
    """The four groups every recipe has, in the same order: mesh, schedule (``schedule``:
    this recipe's defaults, see :func:`add_schedule_flags`), run, checkpoints.
    ``causal_lm``: the run group also takes ``--head-matmul-precision`` (GPTCausalLM's)."""
    add_mesh_flags(p)
    add_schedule_flags(p, **schedule)
    add_run_flags(p, output_dir=output_dir, log_every=log_every, causal_lm=causal_lm)
    add_checkpoint_flags(p)


def add_mesh_flags(p: argparse.ArgumentParser) -> None:
    """``--mesh`` and every feature of ``kdist.distribution`` (one spelling everywhere)."""
    g = p.add_argument_group("mesh and parallelism (kdist.distribution)")
    g.add_argument("--mesh", default="auto",
                   help="axis sizes, e.g. fsdp=8, data=2,fsdp=2,model=2, stage=4,fsdp=2, "
                        "seq=8, replica=2,data=4; auto = the mesh the planner finds fits with "
                        "the least communication (kdist.plan.choose_mesh)")
    g.add_argument("--host-devices", type=positive_int("--host-devices", 8), default=None,
                   help="present the CPU as this many devices (kdist.force_host_devices); "
                        "None: the devices JAX finds")
    g.add_argument("--gradient-reduction", default=None,
                   choices=["float32", "bfloat16", "float8", "int8"],
                   help="kdist reduces each gradient once (reduce-scatter + all-reduce) in "
                        "this type; float8/int8: 8-bit codes on the wire, summed in float32; "
                        "None: XLA places the reductions (kdist.parallel.reduction)")
    g.add_argument("--error-feedback", action="store_true",
                   help="with --gradient-reduction float8/int8: carry each device's "
                        "quantisation error to the next step (in the optimizer state)")
    g.add_argument("--sync-every", type=positive_int("--sync-every", 50), default=None,
                   help="DiLoCo over the mesh's replica axis (needs one in --mesh, e.g. "
                        "replica=2,data=4; --mesh auto then searches meshes with one): "
                        "each group takes this many steps alone, then the groups average "
                        "their parameter change; the last step syncs too (a partial round); "
                        "at most --steps; None with a replica axis: min(50, --steps)")
    g.add_argument("--outer-learning-rate", type=positive_float("--outer-learning-rate", 0.7),
                   default=0.7, help="DiLoCo's outer SGD learning rate (paper: 0.7)")
    g.add_argument("--outer-momentum", type=probability("--outer-momentum", 0.9), default=0.9,
                   help="DiLoCo's outer Nesterov momentum, in [0, 1) (paper: 0.9)")
    g.add_argument("--context-parallel", default="all_gather", choices=["all_gather", "ring"],
                   help="how attention crosses a seq mesh axis: all-gather keys and values, or "
                        "pass them around a ring (less memory)")
    g.add_argument("--no-load-balance", action="store_true",
                   help="seq axis: contiguous token shares (default: each device holds two "
                        "of 2 x seq chunks, equal causal work)")
    g.add_argument("--pipeline-microbatches",
                   type=positive_int("--pipeline-microbatches", 8), default=None,
                   help="with a stage axis in --mesh: microbatches each step's batch is cut "
                        "into; None: one per stage")
    g.add_argument("--pipeline-repeats", type=positive_int("--pipeline-repeats", 2), default=1,
                   help="with a stage axis: circular repeats (non-adjacent stages per device)")
    g.add_argument("--pipeline-schedule", default="auto",
                   choices=["auto", "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"],
                   help="with a stage axis: gpipe (every forward first), 1f1b, "
                        "interleaved_1f1b (with --pipeline-repeats >= 2) or zero_bubble "
                        "(ZB-H1: weight gradients fill idle ticks): at most 2S-2 (zero_bubble S) "
                        "microbatches in flight instead of M; auto: gpipe "
                        "if it fits the device, else 1f1b")


def add_text_flags(g) -> None:
    """The language-model recipes' text: the embedded corpus, local files or TFDS."""
    g.add_argument("--data", default="python-stdlib", type=text_data(),
                   help="python-stdlib, a text file/dir/glob, or tfds:NAME (e.g. tfds:lm1b)")
    g.add_argument("--tfds-data-dir", default=None, help="where TFDS datasets are prepared")
    g.add_argument("--tfds-manual-dir", default=None, help="a TFDS dataset's manual download")
    g.add_argument("--tfds-download", action="store_true", help="let TFDS download and prepare")
    g.add_argument("--encoding", type=text_encoding(), default="utf-8",
                   help="of local text files (e.g. latin-1)")


def add_schedule_flags(p: argparse.ArgumentParser, *, steps: int, learning_rate: float,
                       warmup_steps: int, eval_every: int, weight_decay: float,
                       global_batch_size: int) -> None:
    """Steps, batch and learning-rate schedule; the recipe gives its own defaults.
    ``--warmup-steps`` and ``--eval-every`` default to None: :func:`settle_defaults` sizes
    them to ``--steps``."""
    g = p.add_argument_group("steps, batch and schedule")
    g.add_argument("--steps", type=positive_int("--steps", steps), default=steps,
                   help="optimizer steps")
    g.add_argument("--global-batch-size", default=None,
                   type=positive_int("--global-batch-size", global_batch_size),
                   help=f"sequences per optimizer step; None: {global_batch_size}, rounded "
                        f"up to a multiple of the mesh's batch shards")
    g.add_argument("--grad-accum", type=positive_int("--grad-accum", 2), default=1,
                   help="micro-batches per step (same tokens per step)")
    g.add_argument("--learning-rate", type=positive_float("--learning-rate", learning_rate),
                   default=learning_rate, help="peak, after warmup")
    g.add_argument("--warmup-steps", default=None,
                   type=nonnegative_int("--warmup-steps", warmup_steps),
                   help=f"less than --steps; None: min({warmup_steps}, --steps // 5)")
    g.add_argument("--weight-decay", type=nonnegative_float("--weight-decay", weight_decay),
                   default=weight_decay, help="AdamW's decoupled weight decay (not on biases, "
                                              "norms or embeddings: kdist.optim)")
    g.add_argument("--eval-every", type=positive_int("--eval-every", eval_every), default=None,
                   help=f"steps between validations, dividing --steps; None: {eval_every} "
                        f"if it divides --steps, else the nearest divisor below it (at the "
                        f"end only if none is near)")
    p.set_defaults(_defaults={"warmup_steps": warmup_steps, "eval_every": eval_every,
                              "global_batch_size": global_batch_size})


def add_run_flags(p: argparse.ArgumentParser, output_dir: str, log_every: int,
                  causal_lm: bool = False) -> None:
    """Precision, remat, seed, logs and the output directory (``causal_lm``: and the
    vocabulary head's matmul precision)."""
    g = p.add_argument_group("run")
    g.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="bfloat16 = Keras mixed_bfloat16; auto = float32 on CPU only")
    g.add_argument("--remat", nargs="?", const="block", default="auto", choices=REMAT_CHOICES,
                   help="what each block keeps for the backward pass (kdist.models.remat): "
                        "auto = nothing recomputed on a CPU, the least recompute that fits on "
                        "an accelerator; --remat alone: block")
    g.add_argument("--attention-implementation", default="auto",
                   choices=("auto", "xla", "chunked", "splash", "flash"),
                   help="auto = the fastest measured for the device (kdist's Pallas flash "
                        "kernels on a TPU, XLA's elsewhere; kdist.accelerators)")
    precisions = {
        "--matmul-precision": "the Transformer blocks' projections (kdist.precision): bf16 = "
                              "as --precision computes; int8 / fp8 = quantized forward and "
                              "backward matmuls, float32 weights; int8-sr = int8 with "
                              "stochastically rounded gradients (docs/precision.md)",
        "--head-matmul-precision": "the vocabulary head's matmul (logits = hidden x "
                                   "table^T, and both backward matmuls), quantized as "
                                   "--matmul-precision's; off (bf16) by default: the logits "
                                   "are the most precision-sensitive matmul. int8 rounds "
                                   "the gradient's small probabilities to zero and trains "
                                   "worse; int8-sr keeps them (docs/precision.md)"}
    for flag in list(precisions)[:1 + causal_lm]:  # the head: a causal LM's only
        # kdist.precision.PRECISIONS, literal: no kdist import at parse time
        g.add_argument(flag, default="bf16", choices=("bf16", "int8", "int8-sr", "fp8"),
                       help=precisions[flag])
    g.add_argument("--seed", type=nonnegative_int("--seed", 0), default=0,
                   help="random seed of the weights, data order, dropout, masking and sampling")
    g.add_argument("--output-dir", default=output_dir,
                   help="logs, model.keras, summary.json and (by default) checkpoints")
    g.add_argument("--log-every", type=positive_int("--log-every", log_every),
                   default=log_every, help="optimizer steps per throughput log row")
    g.add_argument("--peak-tflops", type=positive_float("--peak-tflops", 100.0), default=None,
                   help="per-device dense peak for MFU; None: a table, or measured on CPU")
    g.add_argument("--profile-steps", default=None, metavar="A:B",
                   help="JAX profiler trace of steps A..B into OUTPUT_DIR/tensorboard")


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """Checkpoints, resuming, and what a rerun of a finished run does."""
    g = p.add_argument_group("checkpoints (run the same command again to resume exactly)")
    g.add_argument("--checkpoint-dir", default=None, help="None: OUTPUT_DIR/checkpoints")
    g.add_argument("--checkpoint-every", type=nonnegative_int("--checkpoint-every", 50),
                   default=50, help="optimizer steps between checkpoints (0: only at the end "
                                    "and on SIGTERM)")
    g.add_argument("--resume", action="store_true",
                   help="fail unless a checkpoint to resume exists (resuming is automatic); "
                        "a finished run is left alone: pass a larger --steps to extend it")


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit``.

    Example:
        >>> largest_divisor_at_most(70, 50), largest_divisor_at_most(97, 50)
        (35, 1)
    """
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def settle_defaults(args: argparse.Namespace) -> list[str]:
    """Chooses ``--warmup-steps`` and ``--eval-every`` where the user typed none, sized to
    ``--steps``; refuses typed values that cannot work together. Returns one line per
    default chosen differently from the recipe's usual value, for the log.

    Example:
        >>> p = recipe_parser("x")
        >>> add_schedule_flags(p, steps=200, learning_rate=1e-3, warmup_steps=30,
        ...                    eval_every=50, weight_decay=0.1, global_batch_size=16)
        >>> a = p.parse_args(["--steps", "70"])
        >>> settle_defaults(a), a.warmup_steps, a.eval_every
        (['--warmup-steps 14 (default: min(30, --steps // 5))', '--eval-every 35 (default: \
the largest divisor of --steps 70 up to 50)'], 14, 35)
    """
    usual, chosen = args._defaults, []
    if args.warmup_steps is None:
        args.warmup_steps = min(usual["warmup_steps"], args.steps // 5)
        if args.warmup_steps != usual["warmup_steps"]:
            chosen.append(f"--warmup-steps {args.warmup_steps} (default: "
                          f"min({usual['warmup_steps']}, --steps // 5))")
    elif args.warmup_steps >= args.steps:
        raise ValueError(f"--warmup-steps ({args.warmup_steps}) must be less than --steps "
                         f"({args.steps}), or the learning rate never reaches "
                         f"--learning-rate. Pass e.g. --warmup-steps {args.steps // 5}, or "
                         f"leave it out (then min({usual['warmup_steps']}, --steps // 5)).")
    if args.eval_every is None:
        args.eval_every = _default_eval_every(args.steps, usual["eval_every"])
        if args.eval_every != min(usual["eval_every"], args.steps):
            how = ("only at the end: no divisor of --steps near it" if
                   args.eval_every == args.steps else
                   f"the largest divisor of --steps {args.steps} up to {usual['eval_every']}")
            chosen.append(f"--eval-every {args.eval_every} (default: {how})")
    elif args.steps % args.eval_every and args.steps > args.eval_every:
        raise ValueError(f"--steps ({args.steps}) must be a multiple of --eval-every "
                         f"({args.eval_every}). Pass e.g. --eval-every "
                         f"{largest_divisor_at_most(args.steps, args.eval_every)}, or leave "
                         f"it out (then a divisor of --steps is chosen).")
    args.eval_every = min(args.eval_every, args.steps)
    return chosen


def _default_eval_every(steps: int, usual: int) -> int:
    if steps <= usual:
        return steps
    divisor = largest_divisor_at_most(steps, usual)
    return divisor if divisor * 5 >= usual else steps  # a validation every step or two: no


def settle_batch(args: argparse.Namespace, batch_shards: int) -> list[str]:
    """``--global-batch-size`` where the user typed none: the recipe's default rounded up
    to a multiple of ``batch_shards`` (what the mesh and ``--grad-accum`` need per step).

    Example:
        >>> a = argparse.Namespace(global_batch_size=None, grad_accum=1,
        ...                        _defaults={"global_batch_size": 16})
        >>> settle_batch(a, 32), a.global_batch_size
        (['--global-batch-size 32 (default: 16 rounded up to a multiple of 32, the batch \
shards of the mesh x --grad-accum)'], 32)
    """
    usual = args._defaults["global_batch_size"]
    if args.global_batch_size is not None:
        return []
    args.global_batch_size = -(-usual // batch_shards) * batch_shards
    if args.global_batch_size == usual:
        return []
    return [f"--global-batch-size {args.global_batch_size} (default: {usual} rounded up to a "
            f"multiple of {batch_shards}, the batch shards of the mesh x --grad-accum)"]


def check_together(args: argparse.Namespace) -> None:
    """Flags each valid alone but not together, refused naming both (no kdist needed)."""
    if args.global_batch_size is not None and args.global_batch_size % args.grad_accum:
        raise ValueError(f"--grad-accum ({args.grad_accum}) must be a positive divisor of "
                         f"--global-batch-size ({args.global_batch_size}).")
    if getattr(args, "error_feedback", False) and args.gradient_reduction not in ("float8",
                                                                                  "int8"):
        raise ValueError(f"--error-feedback needs --gradient-reduction float8 or int8; got "
                         f"{args.gradient_reduction}.")
    axes = {part.partition("=")[0].strip() for part in args.mesh.lower().split(",")}
    sync_every = getattr(args, "sync_every", None)
    if sync_every and sync_every > args.steps:  # (the mesh's default is never more)
        raise ValueError(f"--sync-every {sync_every} is more than --steps {args.steps}: the "
                         f"DiLoCo groups would synchronise only once, at the last step, as "
                         f"--sync-every {args.steps} does. Pass --sync-every {args.steps} or "
                         f"less, or leave it out (then min(50, --steps)).")
    if sync_every and "replica" not in axes and axes != {"auto"}:
        # (--mesh auto with --sync-every searches meshes with a replica axis)
        raise ValueError(f"--sync-every {sync_every} trains DiLoCo replica groups, which "
                         f"need a replica axis in --mesh; --mesh {args.mesh} has none. "
                         f"Pass e.g. --mesh replica=2,data=4 --sync-every {sync_every}, "
                         f"or leave --sync-every out for synchronous training.")


def command(main) -> None:
    """Runs a recipe's ``main`` as a command. A ``ValueError`` (or a missing file) while the
    run is set up is an input kdist refused, with a message that names the flag and the
    fix: it is printed as one line, ``<recipe>: error: ...``, exit status 2, without the
    traceback around it (``KDIST_TRACEBACK=1`` keeps it). Anything raised once training
    began keeps its traceback."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        if not setting_up or os.environ.get("KDIST_TRACEBACK"):
            raise
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        sys.exit(2)
