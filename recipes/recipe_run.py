"""What every recipe does around its model, after the flags are parsed: devices, mesh,
distribution, precision, and where a run stands (new, resumed, or finished).

The recipes import this module only once their flags are checked (``recipe_options``):
it is the first to load kdist, JAX and Keras.

    state = run_state(args, output_dir, fit_steps=args.steps)
    if state.finished:
        return state.leave_alone()      # says so; writes nothing
    mesh, lines = resolve_mesh(args, cost_model)
    state.announce(mesh)                # "resuming DIR at step N of M on mesh X"
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import kdist  # before keras: it selects Keras' JAX backend if none is chosen

# isort: split
import jax
import keras
import recipe_options as options
from recipe_options import check_together, settle_batch

from kdist.planning.target import running_links

DEFAULT_SYNC_EVERY = 50


def start(args: argparse.Namespace) -> None:
    """Checks ``--profile-steps``, presents the host devices (before JAX starts them) and
    joins the cluster when launched as several processes (a no-op alone). One of separate
    replica group jobs (``python -m kdist.launch --replica-groups G``) keeps its outputs
    and checkpoints in ``OUTPUT_DIR/group-<index>``."""
    kdist.callbacks.parse_profile_steps(args.profile_steps)
    job = kdist.groups.from_environment()
    if job is not None:
        args.output_dir = str(Path(args.output_dir) / f"group-{job.index}")
        if args.checkpoint_dir:
            args.checkpoint_dir = str(Path(args.checkpoint_dir) / f"group-{job.index}")
    if args.host_devices:
        kdist.force_host_devices(args.host_devices)
    kdist.initialize()


def precision(args: argparse.Namespace) -> str:
    """``float32`` or ``bfloat16``: ``--precision auto`` is float32 on CPU only."""
    if args.precision != "auto":
        return args.precision
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def resolve_mesh(args: argparse.Namespace, cost_model, sequence_length: int,
                 dtype: str) -> tuple[str, list[str]]:
    """The mesh spec to train on and the lines that explain a choice. ``--mesh auto`` is the
    planner's choice for every recipe (the mesh that fits with the least communication,
    ``kdist.plan.choose_mesh``) for the model's cost model; the batch is the default one
    (``--global-batch-size`` may be rounded up afterwards to fit the mesh chosen)."""
    if args.mesh.strip().lower() != "auto":
        return args.mesh, []
    batch = args.global_batch_size or args._defaults["global_batch_size"]
    # The slow link's boundary: a TPU's slice (ICI spans its hosts), else a host.
    group, slowdown, boundary = running_links()
    chosen, _, why = kdist.plan.choose_mesh(
        cost_model, jax.device_count(), kdist.plan.default_device_memory(), batch,
        sequence_length, precision=dtype, remat=planned_remat(args),
        grad_accum=args.grad_accum, context_parallel=args.context_parallel,
        pipeline_microbatches=args.pipeline_microbatches,
        pipeline_repeats=args.pipeline_repeats, sync_every=getattr(args, "sync_every", None),
        # The combination table refuses some axes with it ('expert'): auto must know it.
        gradient_reduction=getattr(args, "gradient_reduction", None),
        devices_per_host=group, host_link_slowdown=slowdown, boundary=boundary,
        pipeline_schedule=args.pipeline_schedule)
    lines = [f"mesh auto: {why}"]
    if chosen["stage"] == 1:  # the schedule's flags were for a pipeline auto did not choose
        unused = [f"--pipeline-microbatches {args.pipeline_microbatches}"] * bool(
            args.pipeline_microbatches) + [f"--pipeline-repeats {args.pipeline_repeats}"] * (
            args.pipeline_repeats > 1) + [f"--pipeline-schedule {args.pipeline_schedule}"] * (
            args.pipeline_schedule not in ("gpipe", "auto"))
        args.pipeline_microbatches, args.pipeline_repeats = None, 1
        args.pipeline_schedule = "gpipe"
        if unused:
            lines.append(f"{' and '.join(unused)} left out: the mesh chosen has no pipeline")
    return kdist.plan.mesh_spec(chosen), lines


def mesh_sizes(mesh: str, own: bool = False) -> dict[str, int]:
    """The mesh's axis sizes over the whole job (``own``: this job's devices alone, which
    differ for one of separate replica group jobs: ``replica=1`` there)."""
    try:
        whole, this = kdist.parallel.group_jobs.job_mesh(mesh, jax.device_count())
    except ValueError as e:
        hint = (" On a CPU, --host-devices N presents it as N devices."
                if jax.default_backend() == "cpu" else "")
        raise ValueError(f"--mesh {mesh}: {e}{hint}") from None
    return this if own else whole


def settle_mesh_defaults(args: argparse.Namespace, mesh: str) -> list[str]:
    """The defaults that depend on the mesh: the global batch (a multiple of the batch
    shards: replica x data x fsdp, x the pipeline's microbatches, x --grad-accum) and,
    with a replica axis, ``--sync-every`` (50, or ``--steps`` when fewer: a run shorter
    than one round would sync only at its end). Returns the lines for the log."""
    sizes = mesh_sizes(mesh)
    shards = sizes["replica"] * sizes["data"] * sizes["fsdp"] * args.grad_accum
    if sizes["stage"] > 1:
        shards *= args.pipeline_microbatches or sizes["stage"]
    lines = settle_batch(args, shards)
    if sizes["replica"] > 1 and args.sync_every is None:
        args.sync_every = min(DEFAULT_SYNC_EVERY, args.steps)
        fewer = f", or every --steps {args.steps} when fewer" * (
            args.sync_every < DEFAULT_SYNC_EVERY)
        lines.append(f"--sync-every {args.sync_every} (default with a replica axis in "
                     f"--mesh {mesh}: DiLoCo groups synchronise every {DEFAULT_SYNC_EVERY} "
                     f"steps{fewer})")
    return lines


def resolve_schedule(args: argparse.Namespace, cost_model, mesh: str, dtype: str) -> list[str]:
    """``--pipeline-schedule auto``: the planner's schedule for the mesh and batch
    (``kdist.plan.choose_schedule``: gpipe if it fits the device, else 1f1b), with the line
    that says why when there is a pipeline."""
    if args.pipeline_schedule != "auto":
        return []
    sizes = mesh_sizes(mesh)
    args.pipeline_schedule, why = kdist.plan.choose_schedule(
        cost_model, sizes, kdist.plan.default_device_memory(), args.global_batch_size,
        args.sequence_length, precision=dtype, remat=planned_remat(args),
        grad_accum=args.grad_accum, context_parallel=args.context_parallel,
        pipeline_microbatches=args.pipeline_microbatches,
        pipeline_repeats=args.pipeline_repeats, sync_every=getattr(args, "sync_every", None))
    return [f"--pipeline-schedule auto: {why}"] if sizes["stage"] > 1 else []


DISTRIBUTION_FLAGS = ("gradient_reduction", "error_feedback", "sync_every",
                      "outer_learning_rate", "outer_momentum", "context_parallel",
                      "pipeline_microbatches", "pipeline_repeats", "pipeline_schedule")


def set_distribution(args: argparse.Namespace, mesh: str, dtype: str) -> None:
    """Sets the Keras distribution (every mesh feature flag) and the dtype policy: before
    any model is built. A setting kdist refuses is said with the flags the user types."""
    try:
        dist = kdist.distribution(
            mesh, gradient_reduction=args.gradient_reduction,
            error_feedback=args.error_feedback, sync_every=args.sync_every,
            outer_learning_rate=args.outer_learning_rate, outer_momentum=args.outer_momentum,
            context_parallel=args.context_parallel, load_balance=not args.no_load_balance,
            pipeline_microbatches=args.pipeline_microbatches,
            pipeline_repeats=args.pipeline_repeats, pipeline_schedule=args.pipeline_schedule)
    except ValueError as e:
        raise ValueError(as_flags(str(e))) from None
    keras.distribution.set_distribution(dist)
    keras.config.set_dtype_policy("mixed_bfloat16" if dtype == "bfloat16" else "float32")


def as_flags(message: str) -> str:
    """kdist's message with its keyword arguments spelled as the recipes' flags:
    ``pipeline_repeats=1`` as ``--pipeline-repeats 1``, ``context_parallel`` as
    ``--context-parallel``.

    Example:
        >>> as_flags("got pipeline_repeats=1. Use pipeline_schedule='1f1b'.")
        'got --pipeline-repeats 1. Use --pipeline-schedule 1f1b.'
    """
    value = r"""'([^']*)'|"([^"]*)"|(\d+(?:\.\d+)?(?:e-?\d+)?|\w+)"""
    for name in DISTRIBUTION_FLAGS:
        flag = "--" + name.replace("_", "-")
        message = re.sub(rf"\b{name}=(?:{value})", lambda m, flag=flag: " ".join(
            [flag, next(g for g in m.groups() if g is not None)]), message)
        message = re.sub(rf"\b{name}\b", flag, message)
    return message


def prepare(args: argparse.Namespace, state: RunState, cost_model, chosen: list[str]) -> str:
    """Everything between the flags and the data, in order: the seed, the precision, the
    mesh (``auto``: the planner's), the defaults that depend on it, the "resuming" line
    first, then what was chosen, the checks of the sequence against a ``seq`` axis, the
    distribution, the output directory. Returns the precision."""
    keras.utils.set_random_seed(args.seed)
    dtype = precision(args)
    if isinstance(cost_model, dict):  # a GPT recipe's config: the device's batch for it
        chosen = chosen + device_batch(args, cost_model)
    mesh, explained = resolve_mesh(args, cost_model, args.sequence_length, dtype)
    chosen = chosen + settle_mesh_defaults(args, mesh)
    chosen = chosen + resolve_schedule(args, cost_model, mesh, dtype)
    check_together(args)
    state.announce(mesh)
    for line in explained + [f"default {line}" for line in chosen]:
        print(line)
    check_context(args, mesh)
    try:  # a model axis the heads do not divide: the sizes these devices can form
        kdist.plan.check_model_axis(mesh_sizes(mesh, own=True), cost_model,
                                    jax.device_count())
    except ValueError as e:
        raise ValueError(f"--mesh {mesh}: {e}") from None
    set_distribution(args, mesh, dtype)
    check_batch(args, mesh)
    for line in pipeline_lines(args, mesh):
        print(line)
    state.output_dir.mkdir(parents=True, exist_ok=True)
    return dtype


def check_batch(args: argparse.Namespace, mesh: str) -> None:
    """A ``--global-batch-size`` (per ``--grad-accum`` micro-batch) the mesh's batch axes
    cannot split is refused here, naming the flags, before the data is read (the datasets
    would refuse it later by their arguments' names)."""
    from kdist.parallel.layout import replica_count

    shards, accum = replica_count(), args.grad_accum
    if (args.global_batch_size // accum) % shards == 0:
        return
    step = shards * accum
    below = args.global_batch_size // step * step
    sizes = " or ".join(str(b) for b in (below, below + step) if b)
    per = f" / --grad-accum {accum}" if accum > 1 else ""
    raise ValueError(f"--global-batch-size {args.global_batch_size}{per} does not split over "
                     f"the {shards} batch shards of --mesh {mesh} (replica x data x fsdp). "
                     f"Use a --global-batch-size that is a multiple of {step}, e.g. {sizes}.")


def pipeline_lines(args: argparse.Namespace, mesh: str) -> list[str]:
    """What a ``stage`` axis runs, for the log: the schedule, its microbatches and the
    bubble (the idle share of the devices' time: GPipe's ``(S - 1) / (R M + S - 1)``, a
    scheduled pipeline's from its table of ticks, as ``kdist plan`` counts it)."""
    from kdist.parallel.layout import replica_count
    from kdist.parallel.pipeline import interpreter, schedules
    from kdist.parallel.pipeline.settings import bubble_fraction

    pipe, stages = keras.distribution.distribution().config.pipeline, mesh_sizes(mesh)["stage"]
    if pipe is None:
        return []
    if pipe.schedule == "gpipe":
        bubble = bubble_fraction(stages, pipe.microbatches, pipe.repeats)
    else:
        table = schedules.build(pipe.schedule, stages, pipe.microbatches, pipe.repeats)
        bubble = interpreter.lockstep_bubble(interpreter.Program(table))
    rows = args.global_batch_size // args.grad_accum // replica_count() // pipe.microbatches
    circular = f", {pipe.repeats} stages per device (circular)" if pipe.repeats > 1 else ""
    return [f"pipeline: {pipe.schedule} over stage={stages}, {pipe.microbatches} microbatches "
            f"of {rows} sequence{'s' * (rows != 1)} per batch shard{circular}; bubble "
            f"{bubble:.0%} of the devices' time"]


def check_context(args: argparse.Namespace, mesh: str) -> None:
    """A seq axis must split --sequence-length evenly (into 2 x seq chunks when balanced)."""
    from kdist.parallel.context import SequenceLayout

    seq = mesh_sizes(mesh)["seq"]
    if seq > 1:
        try:
            SequenceLayout(args.sequence_length, seq, balanced=not args.no_load_balance)
        except ValueError as e:
            raise ValueError(f"--sequence-length {args.sequence_length} on --mesh {mesh}: "
                             f"{e}") from None


def remat(args: argparse.Namespace) -> bool | str:
    """The models' ``remat`` argument of ``--remat`` (``none``: False)."""
    return False if args.remat == "none" else args.remat


def planned_remat(args: argparse.Namespace) -> bool | str:
    """``--remat`` as the planner estimates it (``auto``: what it means on this device for
    the recipe's default shapes is decided at the step; planned as no remat)."""
    return False if args.remat in ("none", "auto") else args.remat


def device_batch(args: argparse.Namespace, config: dict) -> list[str]:
    """On an accelerator, the default ``--global-batch-size`` (none typed): the batch
    ``kdist.accelerators.default_batch`` gives each device for this model and sequence
    length (without rematerialisation: the fastest measured on the chip, else the most the
    estimate fits), where it is larger than the recipe's.
    Returns the line for the log."""
    device = kdist.accelerators.target()
    if args.global_batch_size is not None or device.platform == "cpu":
        return []
    full = {**config, "remat": remat(args), "dropout": getattr(args, "dropout", 0.0),
            "attention_implementation": args.attention_implementation,
            "attention_chunk_size": getattr(args, "attention_chunk_size", None)}
    cost = kdist.plan.cost_model_of(full)
    per_device = kdist.accelerators.default_batch(cost, args.sequence_length)
    batch = per_device * jax.device_count()
    if batch <= args._defaults["global_batch_size"]:
        return []
    args._defaults["global_batch_size"] = batch
    return [f"--global-batch-size {batch} ({per_device} per {device.device_kind} device, "
            f"without rematerialisation: kdist.accelerators.default_batch)"]


def flag_values(args: argparse.Namespace) -> dict:
    """The flags as they were used (for summary.json), without the parser's bookkeeping."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


@dataclasses.dataclass
class RunState:
    """Where the run in ``checkpoint_dir`` stands before anything is built: its newest
    committed step (in ``fit`` steps: micro-batches), the mesh it was saved on, the steps
    this run asks for in all."""

    checkpoint_dir: Path
    output_dir: Path
    saved_step: int
    saved_mesh: str | None
    fit_steps: int
    grad_accum: int

    @property
    def finished(self) -> bool:
        return self.saved_step >= self.fit_steps

    @property
    def resumed(self) -> bool:
        return 0 < self.saved_step < self.fit_steps

    def announce(self, mesh: str) -> None:
        """Prints where a resumed run continues; first, before data or models."""
        if not self.resumed:
            return
        moved = (f" (saved on mesh {self.saved_mesh}: resharded as it is read)"
                 if self.saved_mesh and self.saved_mesh != mesh else "")
        print(f"resuming {self.checkpoint_dir} at step {self.saved_step // self.grad_accum} "
              f"of {self.fit_steps // self.grad_accum} on mesh {mesh}{moved}", flush=True)

    def leave_alone(self, args: argparse.Namespace) -> dict:
        """What a rerun of a finished run does: says so, writes nothing."""
        done = self.saved_step // self.grad_accum
        print(f"{self.output_dir}: this run finished at step {done} (checkpoint "
              f"{self.checkpoint_dir / str(self.saved_step)}), so there is nothing to train "
              f"and its outputs are left as they are. To train it further pass a larger "
              f"--steps (e.g. --steps {2 * done}); for a new run pass another --output-dir.",
              flush=True)
        return dict(flag_values(args), finished=True, resumed_from_step=done, tokens=0)


def run_state(args: argparse.Namespace, output_dir: Path) -> RunState:
    """Reads the checkpoint directory's newest committed step (none: a new run, whose old
    throughput log is removed so the new one starts afresh)."""
    from kdist.checkpointing import committed_steps, read_metadata

    checkpoint_dir = Path(args.checkpoint_dir or output_dir / "checkpoints")
    steps = committed_steps(checkpoint_dir)
    saved_step, saved_mesh = 0, None
    if steps:
        try:
            meta = read_metadata(checkpoint_dir / str(steps[-1]))
            saved_step, saved_mesh = int(meta["step"]), meta.get("mesh", {}).get("spec")
        except (kdist.callbacks.CheckpointError, KeyError, ValueError):
            saved_step = steps[-1]  # damaged: the Checkpoint callback will say how
    elif jax.process_index() == 0 and output_dir.is_dir():
        (output_dir / kdist.callbacks.throughput.JSONL_NAME).unlink(missing_ok=True)
    return RunState(checkpoint_dir, output_dir, saved_step, saved_mesh,
                    args.steps * args.grad_accum, args.grad_accum)


def fit_callbacks(args: argparse.Namespace, state: RunState, model, train_data,
                  init_from=None, flops_per_token=None) -> tuple[list, int]:
    """``fit``'s callbacks — ``Throughput`` (tokens/s, MFU, memory, goodput into
    throughput.jsonl, TensorBoard and the progress bar), ``CSVLogger`` (process 0), and
    ``Checkpoint`` last (on SIGTERM it saves, then exits after on_train_end) — and the step
    this run starts from. The checkpoint is restored now, not in ``fit``: that positions
    ``train_data`` and lets the "before" validation describe the resumed model. Checkpoint
    steps count ``fit`` batches (micro-batches with ``--grad-accum``)."""
    job = kdist.groups.from_environment()  # one of separate group jobs: its share's tokens
    throughput = kdist.callbacks.Throughput(
        args.global_batch_size // (job.count if job else 1), args.sequence_length,
        log_dir=state.output_dir,
        log_every=args.log_every, peak_tflops=args.peak_tflops,
        flops_per_token=flops_per_token,
        profile_steps=kdist.callbacks.parse_profile_steps(args.profile_steps))
    checkpoint = kdist.callbacks.Checkpoint(
        state.checkpoint_dir, save_every_steps=args.checkpoint_every * args.grad_accum or None,
        data=train_data, resume="required" if args.resume else "auto", init_from=init_from,
        throughput=throughput)
    start_step = checkpoint.restore(model)
    if job is not None:  # a group rejoining a job that went on: from the job's step
        start_step = kdist.groups.skip_to_job(checkpoint, model, args.steps * args.grad_accum)
    start_step //= args.grad_accum
    options.setting_up = False  # what fails from here on keeps its traceback
    log = ([keras.callbacks.CSVLogger(str(state.output_dir / "log.csv"), append=start_step > 0)]
           if jax.process_index() == 0 else [])  # one writer when there are several
    experts = [kdist.callbacks.ExpertLoad()] if getattr(getattr(
        model, "backbone", None), "moe", None) else []  # before the logs it writes into
    return [throughput, *experts, *log, checkpoint], start_step


def trained_tokens(args: argparse.Namespace, start_step: int) -> int:
    """Tokens this process's run trained: the steps after ``start_step`` (optimizer steps);
    one of separate replica group jobs trains its share of each batch."""
    job = kdist.groups.from_environment()
    return ((args.steps - start_step) * args.global_batch_size // (job.count if job else 1)
            * args.sequence_length)
