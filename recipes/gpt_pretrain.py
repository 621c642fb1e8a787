"""Pretrain a GPT with `model.fit`, sharded over every device.

Runs with no arguments: `gpt-nano` on the embedded corpus (the Python standard library's
source), mesh `auto` (the mesh that fits with the least communication, `kdist.plan`), float32
on CPU and mixed_bfloat16 elsewhere.

Token arithmetic of the defaults:
    tokens per optimizer step = global batch x sequence length = 16 x 256 = 4,096
    tokens per run            = 4,096 x 200 steps              = 819,200
    training split            = ~2.85 M tokens (8,192-entry byte-pair vocabulary),
                                so the run sees ~0.29 of an epoch; no window repeats.
With --grad-accum N, each step is N micro-batches of 16 / N sequences: same tokens per step.

    python recipes/gpt_pretrain.py --mesh data=2,fsdp=2,model=2 --steps 100
    python recipes/gpt_pretrain.py --mesh replica=2,data=4 --sync-every 50   # DiLoCo
    python recipes/gpt_pretrain.py --gradient-reduction float8 --error-feedback
    python recipes/gpt_pretrain.py --mesh stage=4,fsdp=2 --pipeline-microbatches 8
    python recipes/gpt_pretrain.py --preset llama-nano --document-mask
    python recipes/gpt_pretrain.py --preset gpt2-small --sequence-length 1024 --precision bfloat16
    python recipes/gpt_pretrain.py --mesh seq=8 --context-parallel ring --global-batch-size 1 \
        --sequence-length 16384 --max-sequence-length 16384      # context parallelism
    python recipes/gpt_pretrain.py --steps 50 --profile-steps 20:22; kdist report runs/gpt_pretrain
    python recipes/gpt_pretrain.py --data tfds:tiny_shakespeare --tfds-manual-dir ~/downloads
    python -m kdist.launch --processes 2 --devices-per-process 4 recipes/gpt_pretrain.py --steps 50
Checkpoints go to OUTPUT_DIR/checkpoints; running the same command again resumes exactly.
"""

import argparse
import json
import math
import time
from pathlib import Path

import kdist  # before keras: it selects Keras' JAX backend if none is chosen

# isort: split
import jax
import keras
import numpy as np
from recipe_flags import (
    check_sequence_length,
    check_warmup,
    existing_path,
    int_at_least,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    probability,
    text_encoding,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt-nano", help="see kdist.models.GPT_PRESETS")
    p.add_argument("--mesh", default="auto", help="e.g. auto, fsdp=8, data=2,model=4")
    p.add_argument("--host-devices", type=positive_int("--host-devices", 8), default=None,
                   help="present the CPU as this many devices (kdist.force_host_devices); "
                        "default: the devices JAX finds")
    p.add_argument("--data", default="python-stdlib",
                   help="python-stdlib, a text file/dir/glob, or tfds:NAME (e.g. tfds:lm1b)")
    p.add_argument("--tfds-data-dir", default=None, help="where TFDS datasets are prepared")
    p.add_argument("--tfds-manual-dir", default=None, help="a TFDS dataset's manual download")
    p.add_argument("--tfds-download", action="store_true", help="let TFDS download and prepare")
    p.add_argument("--encoding", type=text_encoding(), default="utf-8",
                   help="of local text files (e.g. latin-1); default utf-8")
    p.add_argument("--steps", type=positive_int("--steps", 200), default=200,
                   help="optimizer steps")
    p.add_argument("--global-batch-size", type=positive_int("--global-batch-size", 16),
                   default=16, help="sequences per step")
    p.add_argument("--sequence-length", type=positive_int("--sequence-length", 256),
                   default=256, help="tokens per sequence, at most the preset's positions")
    p.add_argument("--vocabulary-size",
                   type=int_at_least("--vocabulary-size", 258, "256 bytes, end-of-text, a merge"),
                   default=8192, help="byte-pair vocabulary")
    p.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="bfloat16 = Keras mixed_bfloat16; auto = float32 on CPU only")
    p.add_argument("--remat", action="store_true", help="rematerialise each block")
    p.add_argument("--attention-chunk-size", type=positive_int("--attention-chunk-size", 64),
                   default=None,
                   help="attend over key chunks of this size, keeping no probabilities "
                        "(saves memory where no flash attention runs, e.g. CPU)")
    p.add_argument("--max-sequence-length",
                   type=positive_int("--max-sequence-length", 16384), default=None,
                   help="the model's positions (default: the preset's); for long sequences")
    p.add_argument("--context-parallel", default="all_gather", choices=["all_gather", "ring"],
                   help="how attention crosses a seq mesh axis: all-gather keys and values "
                        "(default), or pass them around a ring (less memory)")
    p.add_argument("--no-load-balance", action="store_true",
                   help="seq axis: contiguous token shares (default: each device holds two "
                        "of 2 x seq chunks, equal causal work)")
    p.add_argument("--gradient-reduction", default=None,
                   choices=["float32", "bfloat16", "float8", "int8"],
                   help="kdist reduces each gradient once (reduce-scatter + all-reduce), in "
                        "this type; float8/int8: 8-bit codes on the wire, summed in float32; "
                        "default: XLA places the reductions (kdist.parallel.reduction)")
    p.add_argument("--error-feedback", action="store_true",
                   help="with --gradient-reduction float8/int8: carry each device's "
                        "quantisation error to the next step (in the optimizer state)")
    p.add_argument("--sync-every", type=positive_int("--sync-every", 50), default=None,
                   help="DiLoCo over the mesh's replica axis (e.g. --mesh replica=2,data=4): "
                        "each replica group takes this many steps alone, then the groups "
                        "average their parameter change (kdist.parallel.replicas)")
    p.add_argument("--outer-learning-rate", type=positive_float("--outer-learning-rate", 0.7),
                   default=0.7, help="DiLoCo's outer SGD learning rate (paper: 0.7)")
    p.add_argument("--outer-momentum", type=probability("--outer-momentum", 0.9), default=0.9,
                   help="DiLoCo's outer Nesterov momentum, in [0, 1) (paper: 0.9)")
    p.add_argument("--grad-accum", type=positive_int("--grad-accum", 2), default=1,
                   help="micro-batches per step")
    p.add_argument("--pipeline-microbatches",
                   type=positive_int("--pipeline-microbatches", 8), default=None,
                   help="with a stage axis in --mesh: microbatches each step's batch is cut "
                        "into (default: one per stage)")
    p.add_argument("--pipeline-repeats", type=positive_int("--pipeline-repeats", 2), default=1,
                   help="with a stage axis: circular repeats (non-adjacent stages per device)")
    p.add_argument("--learning-rate", type=positive_float("--learning-rate", 2e-3),
                   default=2e-3, help="peak, after warmup")
    p.add_argument("--warmup-steps", type=nonnegative_int("--warmup-steps", 30), default=30,
                   help="less than --steps")
    p.add_argument("--weight-decay", type=nonnegative_float("--weight-decay", 0.1),
                   default=0.1)
    p.add_argument("--dropout", type=probability("--dropout", 0.1), default=0.0,
                   help="in [0, 1)")
    p.add_argument("--document-mask", action="store_true",
                   help="attention stays within each packed document; positions restart")
    p.add_argument("--eval-every", type=positive_int("--eval-every", 50), default=50,
                   help="steps between validations")
    p.add_argument("--eval-steps", type=positive_int("--eval-steps", 16), default=None,
                   help="validation batches, evenly strided over the validation split "
                        "(default: the whole split)")
    p.add_argument("--sample-length", type=nonnegative_int("--sample-length", 64), default=64,
                   help="tokens to generate at the end")
    p.add_argument("--output-dir", default="runs/gpt_pretrain")
    p.add_argument("--log-every", type=positive_int("--log-every", 10), default=10,
                   help="steps per throughput log row")
    p.add_argument("--peak-tflops", type=positive_float("--peak-tflops", 100.0), default=None,
                   help="per-device dense peak for MFU (default: table, or measured on CPU)")
    p.add_argument("--profile-steps", default=None, metavar="A:B",
                   help="JAX profiler trace of steps A..B into OUTPUT_DIR/tensorboard")
    p.add_argument("--seed", type=nonnegative_int("--seed", 0), default=0)
    p.add_argument("--checkpoint-dir", default=None, help="default OUTPUT_DIR/checkpoints")
    # Checked in check_args (tests/test_recipe_checkpoint.py expects that ValueError).
    p.add_argument("--checkpoint-every", type=int, default=50,
                   help="optimizer steps between checkpoints (also on SIGTERM and at the end)")
    p.add_argument("--resume", action="store_true",
                   help="fail unless a checkpoint to resume exists (resuming is automatic)")
    p.add_argument("--init-from", default=None,
                   type=existing_path("--init-from", "checkpoint dir or .keras file"),
                   help="initial weights only: a checkpoint dir or .keras file; ignored on resume")
    return p.parse_args(argv)


def check_args(args):
    """Refuses flags that are each valid but wrong together, before anything is built."""
    if args.steps % args.eval_every and args.steps > args.eval_every:
        raise ValueError(f"--steps ({args.steps}) must be a multiple of --eval-every "
                         f"({args.eval_every}).")
    if args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0 (0: only at the end and on "
                         f"SIGTERM); got {args.checkpoint_every}. Pass e.g. --checkpoint-every "
                         f"50.")
    if args.global_batch_size % args.grad_accum:
        raise ValueError(f"--grad-accum ({args.grad_accum}) must be a positive divisor of "
                         f"--global-batch-size ({args.global_batch_size}).")
    if args.error_feedback and args.gradient_reduction not in ("float8", "int8"):
        raise ValueError(f"--error-feedback needs --gradient-reduction float8 or int8; got "
                         f"{args.gradient_reduction}.")
    check_warmup(args)
    preset = kdist.models.presets.preset_config(kdist.models.GPT_PRESETS, args.preset)
    if args.max_sequence_length:
        check_sequence_length(args, args.max_sequence_length, "--max-sequence-length")
        return
    try:
        check_sequence_length(args, preset["max_sequence_length"], f"--preset {args.preset}")
    except ValueError as e:
        raise ValueError(f"{e} Or give the model that many positions: --max-sequence-length "
                         f"{args.sequence_length}.") from None


def check_context(args, mesh: str, devices: int):
    """A seq axis must split --sequence-length evenly (into 2 x seq chunks when balanced)."""
    from kdist.parallel.context import SequenceLayout

    seq = kdist.parse_mesh(mesh, devices)["seq"]
    if seq > 1:
        try:
            SequenceLayout(args.sequence_length, seq, balanced=not args.no_load_balance)
        except ValueError as e:
            raise ValueError(f"--sequence-length {args.sequence_length} on --mesh {mesh}: "
                             f"{e}") from None


def _positions(args) -> dict:
    return {"max_sequence_length": args.max_sequence_length} if args.max_sequence_length else {}


def main(argv=None):
    args = parse_args(argv)
    if args.host_devices:  # before anything starts JAX's devices
        kdist.force_host_devices(args.host_devices)
    check_args(args)
    eval_every = min(args.eval_every, args.steps)
    profile_steps = kdist.callbacks.parse_profile_steps(args.profile_steps)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = Path(args.checkpoint_dir or output_dir / "checkpoints")
    kdist.initialize()  # joins the cluster when launched as several processes; else no-op
    if jax.process_index() == 0 and not kdist.callbacks.checkpoint.committed_steps(checkpoint_dir):
        # A new run: start the log afresh (Throughput appends, so a resumed run continues it).
        (output_dir / kdist.callbacks.throughput.JSONL_NAME).unlink(missing_ok=True)
    keras.utils.set_random_seed(args.seed)
    precision = args.precision
    if precision == "auto":
        precision = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    mesh = args.mesh
    if mesh == "auto":  # the mesh that fits with the least communication (kdist.plan)
        config = kdist.models.presets.preset_config(
            kdist.models.GPT_PRESETS, args.preset, vocabulary_size=args.vocabulary_size,
            **_positions(args))
        chosen, _, why = kdist.plan.choose_mesh(
            config, jax.device_count(), kdist.plan.default_device_memory(),
            args.global_batch_size, args.sequence_length, precision=precision,
            remat=args.remat, grad_accum=args.grad_accum,
            context_parallel=args.context_parallel,
            pipeline_microbatches=args.pipeline_microbatches,
            pipeline_repeats=args.pipeline_repeats)
        mesh = kdist.plan.mesh_spec(chosen)
        print(f"mesh auto: {why}")
    check_context(args, mesh, jax.device_count())
    keras.distribution.set_distribution(kdist.distribution(
        mesh, gradient_reduction=args.gradient_reduction, error_feedback=args.error_feedback,
        sync_every=args.sync_every, outer_learning_rate=args.outer_learning_rate,
        outer_momentum=args.outer_momentum, context_parallel=args.context_parallel,
        load_balance=not args.no_load_balance, pipeline_microbatches=args.pipeline_microbatches,
        pipeline_repeats=args.pipeline_repeats))
    keras.config.set_dtype_policy("mixed_bfloat16" if precision == "bfloat16" else "float32")

    micro_batch = args.global_batch_size // args.grad_accum
    data = kdist.data.lm_dataset(
        args.data,
        sequence_length=args.sequence_length,
        global_batch_size=micro_batch,
        vocabulary_size=args.vocabulary_size,
        seed=args.seed,
        validation_steps=args.eval_steps,
        document_mask=args.document_mask,
        tfds_data_dir=args.tfds_data_dir,
        tfds_manual_dir=args.tfds_manual_dir,
        tfds_download=args.tfds_download,
        encoding=args.encoding,
    )
    model = kdist.models.GPTCausalLM.from_preset(
        args.preset,
        vocabulary_size=data.vocabulary_size,
        dropout=args.dropout,
        remat=args.remat,
        document_mask=args.document_mask,
        attention_chunk_size=args.attention_chunk_size,
        **_positions(args),
    )
    model.compile(
        optimizer=kdist.optim.adamw(
            args.learning_rate,
            warmup_steps=args.warmup_steps,
            decay_steps=max(1, args.steps - args.warmup_steps),
            weight_decay=args.weight_decay,
            gradient_accumulation_steps=args.grad_accum,
        )
    )
    throughput = kdist.callbacks.Throughput(
        args.global_batch_size, args.sequence_length, log_dir=output_dir,
        log_every=args.log_every, peak_tflops=args.peak_tflops, profile_steps=profile_steps,
    )  # tokens/s, MFU, memory, goodput -> throughput.jsonl, TensorBoard, progress bar
    # Steps count fit batches (micro-batches with --grad-accum). Restoring now (not in fit)
    # positions data.train and lets the "before" validation loss describe the resumed model.
    checkpoint = kdist.callbacks.Checkpoint(
        checkpoint_dir, save_every_steps=args.checkpoint_every * args.grad_accum or None,
        data=data.train, resume="required" if args.resume else "auto",
        init_from=args.init_from, throughput=throughput,
    )
    start_step = checkpoint.restore(model)
    mesh = keras.distribution.distribution().spec
    print(f"mesh {mesh} over {jax.device_count()} {jax.default_backend()} devices, "
          f"{precision}, {model.count_params():,} parameters, "
          f"{data.train_tokens:,} training tokens")

    print(f"validation loss on {data.validation_coverage}")
    start = time.time()
    untrained = model.evaluate(data.validation, verbose=0, return_dict=True)["loss"]
    print(f"validation loss before training: {untrained:.4f} "
          f"(uniform over the vocabulary: {math.log(data.vocabulary_size):.4f})")
    history = model.fit(
        data.train,
        validation_data=data.validation,
        epochs=args.steps // eval_every,
        steps_per_epoch=eval_every * args.grad_accum,
        shuffle=False,  # batches come shuffled from the dataset
        callbacks=[
            throughput,
            *([keras.callbacks.CSVLogger(str(output_dir / "log.csv"), append=start_step > 0)]
              if jax.process_index() == 0 else []),  # one writer when there are several
            checkpoint,  # last: on SIGTERM it saves, then exits after on_train_end
        ],
    )
    wall = time.time() - start
    trained = history.history.get("val_loss", [untrained])[-1]  # none if already done
    tokens = args.steps * args.global_batch_size * args.sequence_length
    print(f"validation loss after training: {trained:.4f} (before: {untrained:.4f}); "
          f"{tokens:,} tokens in {wall:.0f} s")
    if jax.process_count() > 1:  # generate() and model.save() need every weight in one process
        print(f"{jax.process_count()} processes: no sample and no model.keras (single-process "
              f"only for now); logs in {output_dir.resolve()}")
        return dict(vars(args), mesh=mesh, validation_loss_before=untrained,
                    validation_loss_after=trained, history=history.history)

    prompt = np.asarray(data.tokenizer.tokenize("def "), "int32")[None]
    length = min(prompt.shape[1] + args.sample_length, model.backbone.max_sequence_length)
    sample = data.tokenizer.detokenize(
        model.generate(prompt, max_length=length, sampler="top_k", seed=args.seed)[0]
    )
    print("sample:\n" + sample)

    model.save(output_dir / "model.keras")
    data.tokenizer.save_assets(str(output_dir))
    summary = dict(vars(args), mesh=mesh, resumed_from_step=start_step, precision=precision,
                   tokens=tokens, wall_seconds=wall,
                   validation_loss_before=untrained, validation_loss_after=trained,
                   history=history.history, sample=sample)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(f"outputs written to {output_dir.resolve()}: model.keras, vocabulary.json, "
          f"merges.txt, log.csv, summary.json, throughput.jsonl, tensorboard/ "
          f"(plot: kdist report {output_dir})")
    return summary


if __name__ == "__main__":
    main()
