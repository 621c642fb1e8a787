"""Fine-tune a BERT classifier with `model.fit`, sharded over every device.

Runs with no arguments: the offline task `stdlib-packages` (from 8 lines of source code,
predict which of 6 standard-library packages it comes from; files split between train
and validation), starting from the pretraining run in runs/bert_pretrain if there is one
(`python recipes/bert_pretrain.py` makes it), else from scratch — it says which. Reports
the held-out accuracy against the majority-class baseline and writes model.keras,
log.csv and summary.json to --output-dir.

Arithmetic of the defaults:
    examples per step = 32 windows of at most 128 tokens
    examples per run  = 32 x 300 steps = 9,600, ~1.7 epochs of the ~5.8 k training windows

    python recipes/bert_finetune.py --pretrained runs/bert_pretrain
    python recipes/bert_finetune.py --init-from ~/models/bert-base-uncased   # Hugging Face
    python recipes/bert_finetune.py --from-scratch
    python recipes/bert_finetune.py --task glue/sst2 --data-dir ~/tensorflow_datasets
"""

import argparse
import json
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
    int_at_least,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    probability,
)

DEFAULT_PRETRAINED = "runs/bert_pretrain"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pretrained", default=None,
                   help=f"a bert_pretrain output directory (default: {DEFAULT_PRETRAINED} "
                        f"if it exists)")
    p.add_argument("--init-from", default=None,
                   type=existing_path("--init-from", "Hugging Face BERT directory"),
                   help="a local Hugging Face BERT directory (config.json, safetensors, "
                        "vocab.txt): its encoder, a new classifier head")
    p.add_argument("--from-scratch", action="store_true",
                   help="random initialisation (with --preset) instead of pretrained weights")
    p.add_argument("--preset", default="bert-tiny", help="model shape when from scratch")
    p.add_argument("--vocabulary-size", default=8192,
                   type=int_at_least("--vocabulary-size", 256,
                                     "special tokens and the corpus's characters"),
                   help="WordPiece vocabulary trained on the corpus, when from scratch")
    p.add_argument("--task", default="stdlib-packages",
                   help="stdlib-packages (offline) or a TFDS dataset name, e.g. glue/sst2")
    p.add_argument("--data-dir", default=None, help="TFDS data directory")
    p.add_argument("--download", action="store_true", help="let TFDS download the dataset")
    p.add_argument("--mesh", default="auto", help="e.g. auto, fsdp=8, data=2,model=4")
    p.add_argument("--host-devices", type=positive_int("--host-devices", 8), default=None,
                   help="present the CPU as this many devices (kdist.force_host_devices); "
                        "default: the devices JAX finds")
    p.add_argument("--steps", type=positive_int("--steps", 300), default=300,
                   help="optimizer steps")
    p.add_argument("--global-batch-size", type=positive_int("--global-batch-size", 32),
                   default=32)
    p.add_argument("--sequence-length", default=128,
                   type=int_at_least("--sequence-length", 3, "[CLS] text [SEP]"),
                   help="tokens per example, at most the model's positions")
    p.add_argument("--precision", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--learning-rate", type=positive_float("--learning-rate", 1e-3),
                   default=1e-3, help="peak, after warmup")
    p.add_argument("--warmup-steps", type=nonnegative_int("--warmup-steps", 30), default=30,
                   help="less than --steps")
    p.add_argument("--weight-decay", type=nonnegative_float("--weight-decay", 0.01),
                   default=0.01)
    p.add_argument("--dropout", type=probability("--dropout", 0.1), default=0.1,
                   help="backbone dropout, in [0, 1)")
    p.add_argument("--classifier-dropout", type=probability("--classifier-dropout", 0.1),
                   default=0.1, help="in [0, 1)")
    p.add_argument("--eval-every", type=positive_int("--eval-every", 100), default=100,
                   help="steps between validations (each on the whole validation split)")
    p.add_argument("--output-dir", default="runs/bert_finetune")
    p.add_argument("--seed", type=nonnegative_int("--seed", 0), default=0)
    return p.parse_args(argv)


def pretrained_source(args):
    """The pretraining directory to start from, or None (from scratch); checked early."""
    if args.init_from is not None:
        if args.pretrained or args.from_scratch:
            raise ValueError("Pass either --init-from DIR, --pretrained DIR or --from-scratch, "
                             "not several.")
        return None
    if args.from_scratch:
        if args.pretrained:
            raise ValueError("Pass either --pretrained DIR or --from-scratch, not both.")
        return None
    directory = Path(args.pretrained or DEFAULT_PRETRAINED)
    if not (directory / "model.keras").exists():
        if args.pretrained:  # asked for explicitly: it must be there
            raise ValueError(f"--pretrained {directory} has no model.keras. Run "
                             f"recipes/bert_pretrain.py --output-dir {directory} first, or "
                             f"pass --from-scratch.")
        return None
    for name in ("vocabulary.txt", "summary.json"):
        if not (directory / name).exists():
            raise ValueError(f"{directory} has model.keras but no {name}; it is not a "
                             f"complete bert_pretrain output. Re-run the pretraining.")
    return directory


def check_args(args):
    """Refuses flags that are each valid but wrong together, before anything is built."""
    if args.steps % args.eval_every and args.steps > args.eval_every:
        raise ValueError(f"--steps ({args.steps}) must be positive and a multiple of "
                         f"--eval-every ({args.eval_every}).")
    check_warmup(args)
    if args.from_scratch:
        kdist.models.presets.preset_config(kdist.models.BERT_PRESETS, args.preset)


def check_model_fits(args, config, tokenizer, where):
    """--sequence-length and the vocabulary against the model's config, before it is built."""
    check_sequence_length(args, config["max_sequence_length"], where)
    if tokenizer.vocabulary_size() > config["vocabulary_size"]:
        raise ValueError(f"The vocabulary has {tokenizer.vocabulary_size()} tokens but the model "
                         f"of {where} embeds only {config['vocabulary_size']}: ids from "
                         f"{config['vocabulary_size']} up would give NaN logits. Use the "
                         f"vocabulary.txt the model was pretrained with.")


def main(argv=None):
    args = parse_args(argv)
    if args.host_devices:  # before anything starts JAX's devices
        kdist.force_host_devices(args.host_devices)
    check_args(args)
    eval_every = min(args.eval_every, args.steps)
    source = pretrained_source(args)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    keras.utils.set_random_seed(args.seed)
    keras.distribution.set_distribution(kdist.distribution(args.mesh))
    precision = args.precision
    if precision == "auto":
        precision = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    keras.config.set_dtype_policy("mixed_bfloat16" if precision == "bfloat16" else "float32")

    if args.init_from is not None:  # a Hugging Face directory: its tokenizer and config
        tokenizer = kdist.hf.load_tokenizer(args.init_from)
        config = kdist.hf.backbone_config(args.init_from)
        if "num_segments" not in config:
            raise ValueError(f"--init-from {args.init_from} is not a BERT checkpoint; "
                             f"fine-tune GPT-2 or Llama with recipes/gpt_finetune.py.")
        check_model_fits(args, config, tokenizer, f"--init-from {args.init_from}")
    elif source is not None:
        tokenizer = kdist.data.load_word_piece(source / "vocabulary.txt")
        config = json.loads((source / "summary.json").read_text())["backbone_config"]
        config = {k: v for k, v in config.items() if k not in ("name", "trainable", "dtype")}
        check_model_fits(args, config, tokenizer, f"--pretrained {source}")
    else:
        tokenizer = kdist.data.word_piece_tokenizer(kdist.data.load_corpus(),
                                                    args.vocabulary_size)
        config = kdist.models.presets.preset_config(
            kdist.models.BERT_PRESETS, args.preset, vocabulary_size=tokenizer.vocabulary_size())
        check_model_fits(args, config, tokenizer, f"--preset {args.preset}")
    data = kdist.data.classification_dataset(
        args.task, tokenizer, args.sequence_length, args.global_batch_size, seed=args.seed,
        data_dir=args.data_dir, download=args.download,
    )
    for split in ("train", "validation"):
        kdist.data.check_token_ids(getattr(data, split).token_ids, config["vocabulary_size"],
                                   f"The encoded {split} examples of --task {args.task}")
    if args.init_from is not None:  # streamed into the sharded backbone
        backbone = kdist.models.BertBackbone.from_pretrained(args.init_from,
                                                             dropout=args.dropout)
    elif source is not None:
        backbone = kdist.models.BertBackbone(**{**config, "dropout": args.dropout})
    else:
        backbone = kdist.models.BertBackbone.from_preset(
            args.preset, vocabulary_size=tokenizer.vocabulary_size(), dropout=args.dropout)
    model = kdist.models.BertClassifier(backbone, data.num_classes,
                                        classifier_dropout=args.classifier_dropout)
    if args.init_from is not None:
        print(f"backbone initialised from the Hugging Face checkpoint {args.init_from}")
    elif source is not None:
        kdist.models.load_backbone_weights(model, source)
        print(f"backbone initialised from {source / 'model.keras'}")
    else:
        print("backbone initialised at random (from scratch)")
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
    print(f"task {data.task.name}: {data.num_classes} classes {data.class_names}, "
          f"{data.train_examples:,} training / {data.validation_examples:,} validation "
          f"examples; majority-class baseline {data.majority_baseline:.4f}")
    print(f"mesh {mesh} over {jax.device_count()} {jax.default_backend()} devices, "
          f"{precision}, {model.count_params():,} parameters")

    before = model.evaluate(data.validation, verbose=0, return_dict=True)["loss"]
    print(f"validation loss before fine-tuning: {before:.4f}")
    start = time.time()
    history = model.fit(
        data.train,
        validation_data=data.validation,
        epochs=args.steps // eval_every,
        steps_per_epoch=eval_every,
        shuffle=False,
        callbacks=[keras.callbacks.CSVLogger(str(output_dir / "log.csv"))],
    )
    wall = time.time() - start
    origin = args.init_from or (str(source) if source else None)
    accuracy = history.history["val_accuracy"][-1]
    print(f"held-out accuracy {accuracy:.4f} vs majority-class baseline "
          f"{data.majority_baseline:.4f} ({'pretrained' if origin else 'from scratch'}, "
          f"{args.steps} steps in {wall:.0f} s)")

    model.save(output_dir / "model.keras")
    summary = dict(
        vars(args), mesh=mesh, precision=precision, wall_seconds=wall,
        initialised_from=origin or "scratch", accuracy=accuracy,
        validation_loss_before=before,
        majority_baseline=data.majority_baseline, class_names=data.class_names,
        train_examples=data.train_examples, validation_examples=data.validation_examples,
        history=history.history,
    )
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(f"outputs written to {output_dir.resolve()}: model.keras, log.csv, summary.json")
    return summary


if __name__ == "__main__":
    main()
