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
    python recipes/gpt_pretrain.py --matmul-precision int8    # int8 matmul training
    python recipes/gpt_pretrain.py --matmul-precision int8 --head-matmul-precision int8
    python recipes/gpt_pretrain.py --data tfds:tiny_shakespeare --tfds-manual-dir ~/downloads
    python -m kdist.launch --processes 2 --devices-per-process 4 recipes/gpt_pretrain.py --steps 50
Checkpoints go to OUTPUT_DIR/checkpoints; running the same command again resumes exactly, and
rerunning a finished run trains nothing and leaves its outputs alone (a larger --steps extends
it). Defaults that depend on other flags (warmup, validation interval, batch) adapt to them and
the log says what they chose.
"""

import json
import math
import time
from pathlib import Path

import recipe_options as options
from recipe_flags import (
    check_sequence_length,
    existing_path,
    int_at_least,
    nonnegative_int,
    positive_int,
    preset,
    probability,
)

SEQUENCE_LENGTH = 256  # the default, at most the model's positions


def build_parser():
    """Every flag, its type (a bad value fails here, naming the flag) and default."""
    p = options.recipe_parser(__doc__)
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", default="gpt-nano", type=preset("GPT_PRESETS"),
                   help="see kdist.models.GPT_PRESETS")
    options.add_text_flags(g)
    g.add_argument("--sequence-length", type=positive_int("--sequence-length", 256),
                   default=None, help=f"tokens per sequence; None: {SEQUENCE_LENGTH}, or the "
                                      f"model's positions if fewer")
    g.add_argument("--vocabulary-size",
                   type=int_at_least("--vocabulary-size", 258, "256 bytes, end-of-text, a merge"),
                   default=8192, help="byte-pair vocabulary")
    g.add_argument("--attention-chunk-size", type=positive_int("--attention-chunk-size", 64),
                   default=None,
                   help="attend over key chunks of this size, keeping no probabilities "
                        "(saves memory where no flash attention runs, e.g. CPU)")
    g.add_argument("--max-sequence-length",
                   type=positive_int("--max-sequence-length", 16384), default=None,
                   help="the model's positions (None: the preset's); for long sequences")
    g.add_argument("--dropout", type=probability("--dropout", 0.1), default=0.0,
                   help="in [0, 1)")
    g.add_argument("--document-mask", action="store_true",
                   help="attention stays within each packed document; positions restart")
    g.add_argument("--eval-steps", type=positive_int("--eval-steps", 16), default=None,
                   help="validation batches, evenly strided over the validation split "
                        "(None: the whole split)")
    g.add_argument("--sample-length", type=nonnegative_int("--sample-length", 64), default=64,
                   help="tokens to generate at the end")
    g.add_argument("--init-from", default=None,
                   type=existing_path("--init-from", "checkpoint dir or .keras file"),
                   help="initial weights only: a checkpoint dir or .keras file; ignored on resume")
    options.add_shared_flags(p, output_dir="runs/gpt_pretrain", log_every=10, steps=200,
                             causal_lm=True,
                             learning_rate=2e-3, warmup_steps=30, eval_every=50,
                             weight_decay=0.1, global_batch_size=16)
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def model_config(args, kdist) -> dict:
    """The preset's config as this run builds it; refuses a --sequence-length longer than
    its positions (the default is fitted to them), before anything is built."""
    positions = {"max_sequence_length": args.max_sequence_length} \
        if args.max_sequence_length else {}
    config = kdist.models.presets.preset_config(
        kdist.models.GPT_PRESETS, args.preset, vocabulary_size=args.vocabulary_size,
        **positions)
    limit = config["max_sequence_length"]
    if args.sequence_length is None:
        args.sequence_length = min(SEQUENCE_LENGTH, limit)
    elif args.max_sequence_length:
        check_sequence_length(args, limit, "--max-sequence-length")
    else:
        try:
            check_sequence_length(args, limit, f"--preset {args.preset}")
        except ValueError as e:
            raise ValueError(f"{e} Or give the model that many positions: "
                             f"--max-sequence-length {args.sequence_length}.") from None
    return config


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
    import numpy as np

    run.start(args)
    config = model_config(args, kdist)
    output_dir = Path(args.output_dir)
    state = run.run_state(args, output_dir)
    if state.finished:
        return state.leave_alone(args)
    precision = run.prepare(args, state, config, chosen)

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
        remat=run.remat(args),
        document_mask=args.document_mask,
        attention_chunk_size=args.attention_chunk_size,
        attention_implementation=args.attention_implementation,
        matmul_precision=args.matmul_precision,
        head_matmul_precision=args.head_matmul_precision,
        max_sequence_length=config["max_sequence_length"],
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
    callbacks, start_step = run.fit_callbacks(args, state, model, data.train,
                                              init_from=args.init_from)
    mesh = keras.distribution.distribution().spec
    print(f"mesh {mesh} over {jax.device_count()} {jax.default_backend()} devices, "
          f"{precision}, {model.count_params():,} parameters, "
          f"{data.train_tokens:,} training tokens")

    print(f"validation loss on {data.validation_coverage}")
    start = time.time()
    untrained = model.evaluate(data.validation, verbose=0, return_dict=True)["loss"]
    callbacks[0].record_validation({"loss": untrained}, step=start_step)  # the report's first
    print(f"validation loss before training: {untrained:.4f} "
          f"(uniform over the vocabulary: {math.log(data.vocabulary_size):.4f})")
    history = model.fit(
        data.train,
        validation_data=data.validation,
        epochs=args.steps // args.eval_every,
        steps_per_epoch=args.eval_every * args.grad_accum,
        shuffle=False,  # batches come shuffled from the dataset
        callbacks=callbacks,
    )
    wall = time.time() - start
    trained = history.history["val_loss"][-1]
    tokens = run.trained_tokens(args, start_step)
    print(f"validation loss after training: {trained:.4f} (before: {untrained:.4f}); "
          f"{tokens:,} tokens (steps {start_step + 1}-{args.steps}) in {wall:.0f} s")
    if jax.process_count() > 1:  # generate() and model.save() need every weight in one process
        print(f"{jax.process_count()} processes: no sample and no model.keras (single-process "
              f"only for now); logs in {output_dir.resolve()}")
        return dict(run.flag_values(args), mesh=mesh, validation_loss_before=untrained,
                    validation_loss_after=trained, history=history.history)

    prompt = np.asarray(data.tokenizer.tokenize("def "), "int32")[None]
    length = min(prompt.shape[1] + args.sample_length, model.backbone.max_sequence_length)
    sample = data.tokenizer.detokenize(
        model.generate(prompt, max_length=length, sampler="top_k", seed=args.seed)[0]
    )
    print("sample:\n" + sample)

    model.save(output_dir / "model.keras")
    data.tokenizer.save_assets(str(output_dir))
    summary = dict(run.flag_values(args), mesh=mesh, resumed_from_step=start_step,
                   precision=precision, tokens=tokens, wall_seconds=wall,
                   validation_loss_before=untrained, validation_loss_after=trained,
                   history=history.history, sample=sample)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(f"outputs written to {output_dir.resolve()}: model.keras, vocabulary.json, "
          f"merges.txt, log.csv, summary.json, throughput.jsonl, tensorboard/ "
          f"(plot: {command()} report {output_dir})")
    return summary


if __name__ == "__main__":
    options.command(main)
