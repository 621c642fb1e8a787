"""Pretrain a BERT with masked-language modelling and `model.fit`, sharded over every device.

Runs with no arguments: `bert-tiny` on the embedded corpus (the Python standard library's
source) with an 8,192-entry WordPiece vocabulary trained on it, mesh `auto` (all devices
on `fsdp`), float32 on CPU and mixed_bfloat16 elsewhere. Reports the validation loss and
masked-token accuracy before and after, shows a few masked predictions, and writes
model.keras, vocabulary.txt, log.csv, summary.json, throughput.jsonl and tensorboard/ to
--output-dir; `recipes/bert_finetune.py` starts from that directory.

Token arithmetic of the defaults:
    sequences per step = 32 of 128 tokens   = 4,096 tokens, ~18 of each 128 masked
    tokens per run     = 4,096 x 300 steps  = 1.23 M (9,600 sequences)
    training split     = ~23.6 k packed sequences (2.8 M real tokens): ~0.4 of an epoch,
                         no sequence repeats (so no mask is ever seen twice either).

    python recipes/bert_pretrain.py --mesh data=2,fsdp=2,model=2 --steps 100
    python recipes/bert_pretrain.py --preset bert-base --precision bfloat16 --steps 10000
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
    p.add_argument("--preset", default="bert-tiny", help="see kdist.models.BERT_PRESETS")
    p.add_argument("--mesh", default="auto", help="e.g. auto, fsdp=8, data=2,model=4")
    p.add_argument("--host-devices", type=positive_int("--host-devices", 8), default=None,
                   help="present the CPU as this many devices (kdist.force_host_devices); "
                        "default: the devices JAX finds")
    p.add_argument("--data", default="python-stdlib", help="python-stdlib or a text file/dir/glob")
    p.add_argument("--encoding", type=text_encoding(), default="utf-8",
                   help="of local text files (e.g. latin-1); default utf-8")
    p.add_argument("--vocabulary", default=None,
                   type=existing_path("--vocabulary", "WordPiece vocabulary.txt"),
                   help="a WordPiece vocabulary.txt (default: train one on the corpus)")
    p.add_argument("--vocabulary-size", default=8192,
                   type=int_at_least("--vocabulary-size", 256,
                                     "special tokens and the corpus's characters"),
                   help="when training one")
    p.add_argument("--steps", type=positive_int("--steps", 300), default=300,
                   help="optimizer steps")
    p.add_argument("--global-batch-size", type=positive_int("--global-batch-size", 32),
                   default=32, help="sequences per step")
    p.add_argument("--sequence-length", default=128,
                   type=int_at_least("--sequence-length", 8, "[CLS] A [SEP] B [SEP]"),
                   help="tokens per sequence, at most the preset's positions")
    p.add_argument("--mask-rate", type=probability("--mask-rate", 0.15, zero=False),
                   default=0.15, help="share of tokens selected, in (0, 1)")
    p.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="bfloat16 = Keras mixed_bfloat16; auto = float32 on CPU only")
    p.add_argument("--remat", action="store_true", help="rematerialise each block")
    p.add_argument("--learning-rate", type=positive_float("--learning-rate", 1e-3),
                   default=1e-3, help="peak, after warmup")
    p.add_argument("--warmup-steps", type=nonnegative_int("--warmup-steps", 30), default=30,
                   help="less than --steps")
    p.add_argument("--weight-decay", type=nonnegative_float("--weight-decay", 0.01),
                   default=0.01)
    p.add_argument("--dropout", type=probability("--dropout", 0.1), default=0.0,
                   help="in [0, 1)")
    p.add_argument("--eval-every", type=positive_int("--eval-every", 100), default=100,
                   help="steps between validations")
    p.add_argument("--eval-steps", type=positive_int("--eval-steps", 8), default=None,
                   help="validation batches, evenly strided over the validation split "
                        "(default: the whole split)")
    p.add_argument("--output-dir", default="runs/bert_pretrain")
    p.add_argument("--log-every", type=positive_int("--log-every", 20), default=20,
                   help="steps per throughput log row")
    p.add_argument("--peak-tflops", type=positive_float("--peak-tflops", 100.0), default=None,
                   help="per-device dense peak for MFU (default: table, or measured on CPU)")
    p.add_argument("--seed", type=nonnegative_int("--seed", 0), default=0)
    return p.parse_args(argv)


def check_args(args):
    """Refuses bad flags before anything is built or compiled."""
    if args.steps % args.eval_every and args.steps > args.eval_every:
        raise ValueError(f"--steps ({args.steps}) must be positive and a multiple of "
                         f"--eval-every ({args.eval_every}).")
    check_warmup(args)
    preset = kdist.models.presets.preset_config(kdist.models.BERT_PRESETS, args.preset)
    check_sequence_length(args, preset["max_sequence_length"], f"--preset {args.preset}")


def show_predictions(model, data, count=8):
    """Original, masked input and prediction at the first masked positions of one row."""
    x, y, w = data.validation[0]
    row = {k: v[:1] for k, v in x.items()}
    predicted = np.asarray(model.predict_on_batch(row))[0].argmax(-1)  # (P,)
    tok = data.tokenizer
    lines = []
    for slot in np.flatnonzero(w[0])[:count]:
        position = x["mask_positions"][0, slot]
        shown = tok.id_to_token(int(row["token_ids"][0, position]))
        original = tok.id_to_token(int(y[0, slot]))
        lines.append(f"  position {position:3d}: input {shown!r:10} original {original!r:14} "
                     f"predicted {tok.id_to_token(int(predicted[slot]))!r}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.host_devices:  # before anything starts JAX's devices
        kdist.force_host_devices(args.host_devices)
    check_args(args)
    eval_every = min(args.eval_every, args.steps)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / kdist.callbacks.throughput.JSONL_NAME).unlink(missing_ok=True)

    keras.utils.set_random_seed(args.seed)
    keras.distribution.set_distribution(kdist.distribution(args.mesh))
    precision = args.precision
    if precision == "auto":
        precision = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    keras.config.set_dtype_policy("mixed_bfloat16" if precision == "bfloat16" else "float32")

    data = kdist.data.mlm_dataset(
        args.data,
        sequence_length=args.sequence_length,
        global_batch_size=args.global_batch_size,
        vocabulary_size=args.vocabulary_size,
        vocabulary=args.vocabulary,
        seed=args.seed,
        validation_steps=args.eval_steps,
        mask_selection_rate=args.mask_rate,
        encoding=args.encoding,
    )
    model = kdist.models.BertMaskedLM.from_preset(
        args.preset, vocabulary_size=data.vocabulary_size, dropout=args.dropout, remat=args.remat
    )
    model.compile(
        optimizer=kdist.optim.adamw(
            args.learning_rate,
            warmup_steps=args.warmup_steps,
            decay_steps=max(1, args.steps - args.warmup_steps),
            weight_decay=args.weight_decay,
            beta_2=0.98,
        )
    )
    mesh = keras.distribution.distribution().spec
    print(f"mesh {mesh} over {jax.device_count()} {jax.default_backend()} devices, "
          f"{precision}, {model.count_params():,} parameters, "
          f"{data.train_sequences:,} training sequences of {args.sequence_length} tokens, "
          f"{data.mask_selection_length} masked slots per sequence")

    print(f"validation on {data.validation_coverage}")
    start = time.time()
    before = model.evaluate(data.validation, verbose=0, return_dict=True)
    print(f"before training: validation loss {before['loss']:.4f} (uniform over the "
          f"vocabulary: {math.log(data.vocabulary_size):.4f}), masked-token accuracy "
          f"{before['masked_accuracy']:.4f}")
    flops = model.cost_model_for(  # the MLM head at the masked positions actually trained
        model.backbone.get_config(), masked_positions=data.mask_selection_length,
    ).flops_per_token(args.sequence_length)
    history = model.fit(
        data.train,
        validation_data=data.validation,
        epochs=args.steps // eval_every,
        steps_per_epoch=eval_every,
        shuffle=False,  # batches come shuffled (and freshly masked) from the dataset
        callbacks=[
            kdist.callbacks.Throughput(
                args.global_batch_size, args.sequence_length, log_dir=output_dir,
                log_every=args.log_every, peak_tflops=args.peak_tflops,
                flops_per_token=flops.training,
            ),
            keras.callbacks.CSVLogger(str(output_dir / "log.csv")),
        ],
    )
    wall = time.time() - start
    after = {"loss": history.history["val_loss"][-1],
             "masked_accuracy": history.history["val_masked_accuracy"][-1]}
    tokens = args.steps * args.global_batch_size * args.sequence_length
    print(f"after training: validation loss {after['loss']:.4f} (before {before['loss']:.4f}), "
          f"masked-token accuracy {after['masked_accuracy']:.4f} "
          f"(before {before['masked_accuracy']:.4f}); {tokens:,} tokens in {wall:.0f} s")
    predictions = show_predictions(model, data)
    print("masked predictions on a validation sequence:\n" + predictions)

    model.save(output_dir / "model.keras")
    data.tokenizer.save_assets(str(output_dir))  # vocabulary.txt
    summary = dict(
        vars(args), mesh=mesh, precision=precision, tokens=tokens, wall_seconds=wall,
        validation_loss_before=before["loss"], validation_loss_after=after["loss"],
        masked_accuracy_before=before["masked_accuracy"],
        masked_accuracy_after=after["masked_accuracy"],
        flops_per_token=flops.as_dict(), history=history.history,
        backbone_config=model.backbone.get_config(),
    )
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(f"outputs written to {output_dir.resolve()}: model.keras, vocabulary.txt, log.csv, "
          f"summary.json, throughput.jsonl, tensorboard/ (fine-tune: python "
          f"recipes/bert_finetune.py --pretrained {output_dir})")
    return summary


if __name__ == "__main__":
    main()
