"""Fine-tune a pretrained GPT-2 or Llama checkpoint with `model.fit`, sharded over every device.

--init-from is a local Hugging Face model directory (config.json, model.safetensors or a
sharded index, and the tokenizer's files: tokenizer.json or vocab.json + merges.txt). The
weights stream straight into the sharded model (kdist.models.hf); the data (the embedded
corpus, local text or TFDS) is encoded with the checkpoint's own tokenizer. Prints the
validation loss before and after, checkpoints like recipes/gpt_pretrain.py (run the same
command again to resume exactly), and writes the fine-tuned model back in Hugging Face
format to OUTPUT_DIR/hf (or --export-dir), ready for transformers or another from_pretrained.

Token arithmetic of the defaults:
    tokens per optimizer step = global batch x sequence length = 16 x 256 = 4,096
    tokens per run            = 4,096 x 100 steps              = 409,600

    huggingface-cli download gpt2 --local-dir ~/models/gpt2        # (on a networked machine)
    python recipes/gpt_finetune.py --init-from ~/models/gpt2 --mesh fsdp=8
    python recipes/gpt_finetune.py --init-from ~/models/Llama-3.2-1B --data ~/text/ \\
        --mesh fsdp=4,model=2 --precision bfloat16 --sequence-length 1024
    python -m kdist.launch --processes 2 --devices-per-process 4 recipes/gpt_finetune.py ...
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
from recipe_flags import (
    check_sequence_length,
    check_warmup,
    existing_path,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    probability,
    text_encoding,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--init-from", required=True,
                   type=existing_path("--init-from", "Hugging Face model directory"),
                   help="a local Hugging Face GPT-2 or Llama directory (weights, config, "
                        "tokenizer)")
    p.add_argument("--mesh", default="auto", help="e.g. auto, fsdp=8, data=2,model=4")
    p.add_argument("--host-devices", type=positive_int("--host-devices", 8), default=None,
                   help="present the CPU as this many devices (kdist.force_host_devices)")
    p.add_argument("--data", default="python-stdlib",
                   help="python-stdlib, a text file/dir/glob, or tfds:NAME")
    p.add_argument("--tfds-data-dir", default=None, help="where TFDS datasets are prepared")
    p.add_argument("--tfds-manual-dir", default=None, help="a TFDS dataset's manual download")
    p.add_argument("--tfds-download", action="store_true", help="let TFDS download and prepare")
    p.add_argument("--encoding", type=text_encoding(), default="utf-8",
                   help="of local text files; default utf-8")
    p.add_argument("--steps", type=positive_int("--steps", 100), default=100,
                   help="optimizer steps")
    p.add_argument("--global-batch-size", type=positive_int("--global-batch-size", 16),
                   default=16, help="sequences per step")
    p.add_argument("--sequence-length", type=positive_int("--sequence-length", 256),
                   default=256, help="tokens per sequence, at most the model's positions")
    p.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="bfloat16 = Keras mixed_bfloat16; auto = float32 on CPU only")
    p.add_argument("--remat", action="store_true", help="rematerialise each block")
    p.add_argument("--attention-chunk-size", type=positive_int("--attention-chunk-size", 64),
                   default=None, help="attend over key chunks (no kept probabilities)")
    p.add_argument("--grad-accum", type=positive_int("--grad-accum", 2), default=1,
                   help="micro-batches per step")
    p.add_argument("--learning-rate", type=positive_float("--learning-rate", 1e-4),
                   default=1e-4, help="peak, after warmup")
    p.add_argument("--warmup-steps", type=nonnegative_int("--warmup-steps", 10), default=10,
                   help="less than --steps")
    p.add_argument("--weight-decay", type=nonnegative_float("--weight-decay", 0.01),
                   default=0.01)
    p.add_argument("--dropout", type=probability("--dropout", 0.1), default=None,
                   help="residual dropout (default: the checkpoint's config)")
    p.add_argument("--eval-every", type=positive_int("--eval-every", 50), default=50,
                   help="steps between validations")
    p.add_argument("--eval-steps", type=positive_int("--eval-steps", 16), default=None,
                   help="validation batches, evenly strided over the split (default: all)")
    p.add_argument("--output-dir", default="runs/gpt_finetune")
    p.add_argument("--export-dir", default=None,
                   help="where the fine-tuned Hugging Face checkpoint goes (OUTPUT_DIR/hf)")
    p.add_argument("--log-every", type=positive_int("--log-every", 10), default=10)
    p.add_argument("--peak-tflops", type=positive_float("--peak-tflops", 100.0), default=None)
    p.add_argument("--seed", type=nonnegative_int("--seed", 0), default=0)
    p.add_argument("--checkpoint-dir", default=None, help="default OUTPUT_DIR/checkpoints")
    p.add_argument("--checkpoint-every", type=nonnegative_int("--checkpoint-every", 50),
                   default=50, help="optimizer steps between checkpoints (0: end and SIGTERM)")
    p.add_argument("--resume", action="store_true",
                   help="fail unless a checkpoint to resume exists (resuming is automatic)")
    return p.parse_args(argv)


def check_args(args) -> dict:
    """Refuses flags wrong together and a directory kdist cannot fine-tune, before any
    model or data is built. Returns the checkpoint's kdist backbone config."""
    if args.steps % args.eval_every and args.steps > args.eval_every:
        raise ValueError(f"--steps ({args.steps}) must be a multiple of --eval-every "
                         f"({args.eval_every}).")
    if args.global_batch_size % args.grad_accum:
        raise ValueError(f"--grad-accum ({args.grad_accum}) must be a positive divisor of "
                         f"--global-batch-size ({args.global_batch_size}).")
    check_warmup(args)
    try:
        config = kdist.hf.backbone_config(args.init_from)
    except ValueError as e:
        raise ValueError(f"--init-from {args.init_from}: {e}") from None
    if "num_segments" in config:
        raise ValueError(f"--init-from {args.init_from} is a BERT checkpoint; fine-tune it with "
                         f"recipes/bert_finetune.py --init-from {args.init_from}.")
    check_sequence_length(args, config["max_sequence_length"], f"--init-from {args.init_from}")
    return config


def end_of_text(tokenizer) -> str:
    """The token the checkpoint's tokenizer ends a document with."""
    token = getattr(tokenizer, "end_token", None)
    return token if isinstance(token, str) else "<|endoftext|>"


def main(argv=None):
    args = parse_args(argv)
    if args.host_devices:  # before anything starts JAX's devices
        kdist.force_host_devices(args.host_devices)
    config = check_args(args)
    eval_every = min(args.eval_every, args.steps)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = Path(args.checkpoint_dir or output_dir / "checkpoints")
    export_dir = Path(args.export_dir or output_dir / "hf")
    kdist.initialize()  # joins the cluster when launched as several processes; else no-op
    if jax.process_index() == 0 and not kdist.callbacks.checkpoint.committed_steps(checkpoint_dir):
        (output_dir / kdist.callbacks.throughput.JSONL_NAME).unlink(missing_ok=True)
    keras.utils.set_random_seed(args.seed)
    precision = args.precision
    if precision == "auto":
        precision = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    mesh = args.mesh
    if mesh == "auto":
        chosen, _, why = kdist.plan.choose_mesh(
            config, jax.device_count(), kdist.plan.default_device_memory(),
            args.global_batch_size, args.sequence_length, precision=precision,
            remat=args.remat, grad_accum=args.grad_accum)
        mesh = kdist.plan.mesh_spec(chosen)
        print(f"mesh auto: {why}")
    keras.distribution.set_distribution(kdist.distribution(mesh))
    keras.config.set_dtype_policy("mixed_bfloat16" if precision == "bfloat16" else "float32")

    tokenizer = kdist.hf.load_tokenizer(args.init_from)
    if tokenizer.vocabulary_size() > config["vocabulary_size"]:
        raise ValueError(f"The tokenizer in --init-from {args.init_from} has "
                         f"{tokenizer.vocabulary_size()} tokens but the model embeds only "
                         f"{config['vocabulary_size']}: the directory's tokenizer and weights "
                         f"do not belong together.")
    micro_batch = args.global_batch_size // args.grad_accum
    data = kdist.data.lm_dataset(
        args.data, sequence_length=args.sequence_length, global_batch_size=micro_batch,
        seed=args.seed, validation_steps=args.eval_steps, tfds_data_dir=args.tfds_data_dir,
        tfds_manual_dir=args.tfds_manual_dir, tfds_download=args.tfds_download,
        encoding=args.encoding, tokenizer=tokenizer, end_of_text=end_of_text(tokenizer))
    start = time.time()
    overrides = dict(remat=args.remat, attention_chunk_size=args.attention_chunk_size)
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    model = kdist.models.GPTCausalLM.from_pretrained(args.init_from, **overrides)
    print(f"loaded {args.init_from} ({model.count_params():,} parameters) in "
          f"{time.time() - start:.1f} s, sharded as it was read")
    model.compile(optimizer=kdist.optim.adamw(
        args.learning_rate, warmup_steps=args.warmup_steps,
        decay_steps=max(1, args.steps - args.warmup_steps), weight_decay=args.weight_decay,
        gradient_accumulation_steps=args.grad_accum))
    throughput = kdist.callbacks.Throughput(
        args.global_batch_size, args.sequence_length, log_dir=output_dir,
        log_every=args.log_every, peak_tflops=args.peak_tflops)
    checkpoint = kdist.callbacks.Checkpoint(
        checkpoint_dir, save_every_steps=args.checkpoint_every * args.grad_accum or None,
        data=data.train, resume="required" if args.resume else "auto", throughput=throughput)
    start_step = checkpoint.restore(model)  # a resumed run continues from its own weights
    mesh = keras.distribution.distribution().spec
    print(f"mesh {mesh} over {jax.device_count()} {jax.default_backend()} devices, "
          f"{precision}, {data.train_tokens:,} training tokens; validation on "
          f"{data.validation_coverage}")

    start = time.time()
    before = model.evaluate(data.validation, verbose=0, return_dict=True)["loss"]
    print(f"validation loss before fine-tuning: {before:.4f} (uniform over the vocabulary: "
          f"{math.log(data.vocabulary_size):.4f})")
    history = model.fit(
        data.train, validation_data=data.validation, epochs=args.steps // eval_every,
        steps_per_epoch=eval_every * args.grad_accum, shuffle=False,
        callbacks=[throughput,
                   *([keras.callbacks.CSVLogger(str(output_dir / "log.csv"),
                                                append=start_step > 0)]
                     if jax.process_index() == 0 else []),
                   checkpoint])
    wall = time.time() - start
    after = history.history.get("val_loss", [before])[-1]
    tokens = args.steps * args.global_batch_size * args.sequence_length
    print(f"validation loss after fine-tuning: {after:.4f} (before: {before:.4f}); "
          f"{tokens:,} tokens in {wall:.0f} s")
    model.save_pretrained(export_dir, tokenizer=tokenizer)  # every process joins the gathers
    summary = dict(vars(args), mesh=mesh, precision=precision, resumed_from_step=start_step,
                   tokens=tokens, wall_seconds=wall, validation_loss_before=before,
                   validation_loss_after=after, history=history.history,
                   export_dir=str(export_dir))
    if jax.process_index() == 0:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(f"fine-tuned Hugging Face checkpoint in {export_dir.resolve()}; logs in "
          f"{output_dir.resolve()} (plot: kdist report {output_dir})")
    return summary


if __name__ == "__main__":
    main()
