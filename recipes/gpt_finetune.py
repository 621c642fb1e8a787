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
The mesh, checkpoint and schedule flags are gpt_pretrain.py's (recipes/recipe_options.py);
a finished run is left alone.
"""

import json
import math
import time
from pathlib import Path

import recipe_options as options
from recipe_flags import (
    check_sequence_length,
    existing_path,
    positive_int,
    probability,
)

SEQUENCE_LENGTH = 256  # the default, at most the checkpoint's positions


def build_parser():
    """Every flag, its type (a bad value fails here, naming the flag) and default."""
    p = options.recipe_parser(__doc__)
    g = p.add_argument_group("model and data")
    g.add_argument("--init-from", required=True,
                   type=existing_path("--init-from", "Hugging Face model directory"),
                   help="a local Hugging Face GPT-2 or Llama directory (weights, config, "
                        "tokenizer)")
    options.add_text_flags(g)
    g.add_argument("--sequence-length", type=positive_int("--sequence-length", 256),
                   default=None, help=f"tokens per sequence; None: {SEQUENCE_LENGTH}, or the "
                                      f"checkpoint's positions if fewer")
    g.add_argument("--attention-chunk-size", type=positive_int("--attention-chunk-size", 64),
                   default=None, help="attend over key chunks (no kept probabilities)")
    g.add_argument("--dropout", type=probability("--dropout", 0.1), default=None,
                   help="residual dropout (None: the checkpoint's config)")
    g.add_argument("--eval-steps", type=positive_int("--eval-steps", 16), default=None,
                   help="validation batches, evenly strided over the split (None: all)")
    g.add_argument("--export-dir", default=None,
                   help="where the fine-tuned Hugging Face checkpoint goes (None: OUTPUT_DIR/hf)")
    options.add_shared_flags(p, output_dir="runs/gpt_finetune", log_every=10, steps=100,
                             causal_lm=True,
                             learning_rate=1e-4, warmup_steps=10, eval_every=50,
                             weight_decay=0.01, global_batch_size=16)
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def checkpoint_config(args, kdist) -> dict:
    """The checkpoint's kdist backbone config; refuses a directory kdist cannot fine-tune
    and a --sequence-length beyond its positions (the default is fitted to them)."""
    try:
        config = kdist.hf.backbone_config(args.init_from)
    except ValueError as e:
        raise ValueError(f"--init-from {args.init_from}: {e}") from None
    if "num_segments" in config:
        raise ValueError(f"--init-from {args.init_from} is a BERT checkpoint; fine-tune it with "
                         f"recipes/bert_finetune.py --init-from {args.init_from}.")
    if args.sequence_length is None:
        args.sequence_length = min(SEQUENCE_LENGTH, config["max_sequence_length"])
    check_sequence_length(args, config["max_sequence_length"], f"--init-from {args.init_from}")
    return config


def end_of_text(tokenizer) -> str:
    """The token the checkpoint's tokenizer ends a document with."""
    token = getattr(tokenizer, "end_token", None)
    return token if isinstance(token, str) else "<|endoftext|>"


def main(argv=None):
    args = parse_args(argv)
    chosen = options.settle_defaults(args)  # --help and every flag error come before this line
    options.check_together(args)
    import recipe_run as run  # the first import of kdist, JAX and Keras

    import kdist
    from kdist.cli import command

    # isort: split
    import jax
    import keras

    run.start(args)
    config = checkpoint_config(args, kdist)
    output_dir = Path(args.output_dir)
    export_dir = Path(args.export_dir or output_dir / "hf")
    state = run.run_state(args, output_dir)
    if state.finished:
        return state.leave_alone(args)
    precision = run.prepare(args, state, config, chosen)

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
    overrides = dict(remat=run.remat(args), attention_chunk_size=args.attention_chunk_size,
                     attention_implementation=args.attention_implementation,
                     matmul_precision=args.matmul_precision,
                     head_matmul_precision=args.head_matmul_precision)
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    model = kdist.models.GPTCausalLM.from_pretrained(args.init_from, **overrides)
    print(f"loaded {args.init_from} ({model.count_params():,} parameters) in "
          f"{time.time() - start:.1f} s, sharded as it was read")
    model.compile(optimizer=kdist.optim.adamw(
        args.learning_rate, warmup_steps=args.warmup_steps,
        decay_steps=max(1, args.steps - args.warmup_steps), weight_decay=args.weight_decay,
        gradient_accumulation_steps=args.grad_accum))
    callbacks, start_step = run.fit_callbacks(args, state, model, data.train)
    mesh = keras.distribution.distribution().spec
    print(f"mesh {mesh} over {jax.device_count()} {jax.default_backend()} devices, "
          f"{precision}, {data.train_tokens:,} training tokens; validation on "
          f"{data.validation_coverage}")

    start = time.time()
    before = model.evaluate(data.validation, verbose=0, return_dict=True)["loss"]
    callbacks[0].record_validation({"loss": before}, step=start_step)  # the report's first point
    print(f"validation loss before fine-tuning: {before:.4f} (uniform over the vocabulary: "
          f"{math.log(data.vocabulary_size):.4f})")
    history = model.fit(
        data.train, validation_data=data.validation, epochs=args.steps // args.eval_every,
        steps_per_epoch=args.eval_every * args.grad_accum, shuffle=False,
        callbacks=callbacks)
    wall = time.time() - start
    after = history.history["val_loss"][-1]
    tokens = run.trained_tokens(args, start_step)
    print(f"validation loss after fine-tuning: {after:.4f} (before: {before:.4f}); "
          f"{tokens:,} tokens (steps {start_step + 1}-{args.steps}) in {wall:.0f} s")
    model.save_pretrained(export_dir, tokenizer=tokenizer)  # every process joins the gathers
    summary = dict(run.flag_values(args), mesh=mesh, precision=precision,
                   resumed_from_step=start_step, tokens=tokens, wall_seconds=wall,
                   validation_loss_before=before, validation_loss_after=after,
                   history=history.history, export_dir=str(export_dir))
    if jax.process_index() == 0:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(f"fine-tuned Hugging Face checkpoint in {export_dir.resolve()}; logs in "
          f"{output_dir.resolve()} (plot: {command()} report {output_dir})")
    return summary


if __name__ == "__main__":
    options.command(main)
