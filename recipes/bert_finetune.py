"""Fine-tune a BERT classifier with `model.fit`, sharded over every device.

Runs with no arguments: the offline task `stdlib-packages` (from 8 lines of source code,
predict which of 6 standard-library packages it comes from; files split between train
and validation), starting from the pretraining run in runs/bert_pretrain if there is one
(`python recipes/bert_pretrain.py` makes it), else from scratch — it says which. Reports
the held-out accuracy against the majority-class baseline and writes model.keras, its
vocabulary.txt, log.csv and summary.json to --output-dir, and the classifier in Hugging Face
format, with its tokenizer and label names, to OUTPUT_DIR/hf (or --export-dir).

Arithmetic of the defaults:
    examples per step = 32 windows of at most 128 tokens
    examples per run  = 32 x 300 steps = 9,600, ~1.7 epochs of the ~5.8 k training windows

    python recipes/bert_finetune.py --pretrained runs/bert_pretrain
    python recipes/bert_finetune.py --init-from ~/models/bert-base-uncased   # Hugging Face
    python recipes/bert_finetune.py --from-scratch
    python recipes/bert_finetune.py --task glue/sst2 --data-dir ~/tensorflow_datasets
The mesh, checkpoint and schedule flags are gpt_pretrain.py's (recipes/recipe_options.py):
running the same command again resumes exactly; a finished run is left alone.
"""

import json
import time
from pathlib import Path

import recipe_options as options
from recipe_flags import (
    check_sequence_length,
    existing_path,
    int_at_least,
    preset,
    probability,
)

DEFAULT_PRETRAINED = "runs/bert_pretrain"
SEQUENCE_LENGTH = 128  # the default, at most the model's positions


def build_parser():
    """Every flag, its type (a bad value fails here, naming the flag) and default."""
    p = options.recipe_parser(__doc__)
    g = p.add_argument_group("model and data")
    g.add_argument("--pretrained", default=None,
                   help=f"a bert_pretrain output directory (None: {DEFAULT_PRETRAINED} if it "
                        f"exists)")
    g.add_argument("--init-from", default=None,
                   type=existing_path("--init-from", "Hugging Face BERT directory"),
                   help="a local Hugging Face BERT directory (config.json, safetensors, "
                        "vocab.txt): its encoder, a new classifier head")
    g.add_argument("--from-scratch", action="store_true",
                   help="random initialisation (with --preset) instead of pretrained weights")
    g.add_argument("--preset", default="bert-tiny", type=preset("BERT_PRESETS"),
                   help="model shape when from scratch")
    g.add_argument("--vocabulary-size", default=8192,
                   type=int_at_least("--vocabulary-size", 256,
                                     "special tokens and the corpus's characters"),
                   help="WordPiece vocabulary trained on the corpus, when from scratch")
    g.add_argument("--task", default="stdlib-packages",
                   help="stdlib-packages (offline) or a TFDS dataset name, e.g. glue/sst2")
    g.add_argument("--data-dir", default=None, help="TFDS data directory")
    g.add_argument("--download", action="store_true", help="let TFDS download the dataset")
    g.add_argument("--sequence-length", default=None,
                   type=int_at_least("--sequence-length", 3, "[CLS] text [SEP]"),
                   help="tokens per example; None: 128, or the model's positions if fewer")
    g.add_argument("--dropout", type=probability("--dropout", 0.1), default=0.1,
                   help="backbone dropout, in [0, 1)")
    g.add_argument("--classifier-dropout", type=probability("--classifier-dropout", 0.1),
                   default=0.1, help="in [0, 1)")
    g.add_argument("--export-dir", default=None,
                   help="where the Hugging Face classifier goes (None: OUTPUT_DIR/hf)")
    options.add_shared_flags(p, output_dir="runs/bert_finetune", log_every=20, steps=300,
                             learning_rate=1e-3, warmup_steps=30, eval_every=100,
                             weight_decay=0.01, global_batch_size=32)
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


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


def check_model_fits(args, config, tokenizer, where):
    """--sequence-length (None: fitted to the model) and the vocabulary against the model's
    config, before it is built."""
    if args.sequence_length is None:
        args.sequence_length = min(SEQUENCE_LENGTH, config["max_sequence_length"])
    check_sequence_length(args, config["max_sequence_length"], where)
    if tokenizer.vocabulary_size() > config["vocabulary_size"]:
        raise ValueError(f"The vocabulary has {tokenizer.vocabulary_size()} tokens but the model "
                         f"of {where} embeds only {config['vocabulary_size']}: ids from "
                         f"{config['vocabulary_size']} up would give NaN logits. Use the "
                         f"vocabulary.txt the model was pretrained with.")


def source_model(args, kdist, source):
    """``(tokenizer, backbone config, where)`` of the model this run starts from."""
    if args.init_from is not None:  # a Hugging Face directory: its tokenizer and config
        tokenizer = kdist.hf.load_tokenizer(args.init_from)
        config = kdist.hf.backbone_config(args.init_from)
        if "num_segments" not in config:
            raise ValueError(f"--init-from {args.init_from} is not a BERT checkpoint; "
                             f"fine-tune GPT-2 or Llama with recipes/gpt_finetune.py.")
        return tokenizer, config, f"--init-from {args.init_from}"
    if source is not None:
        tokenizer = kdist.data.load_word_piece(source / "vocabulary.txt")
        config = json.loads((source / "summary.json").read_text())["backbone_config"]
        config = {k: v for k, v in config.items() if k not in ("name", "trainable", "dtype")}
        return tokenizer, config, f"--pretrained {source}"
    kdist.models.presets.preset_config(kdist.models.BERT_PRESETS, args.preset)  # the name
    tokenizer = kdist.data.word_piece_tokenizer(kdist.data.load_corpus(), args.vocabulary_size)
    config = kdist.models.presets.preset_config(
        kdist.models.BERT_PRESETS, args.preset, vocabulary_size=tokenizer.vocabulary_size())
    return tokenizer, config, f"--preset {args.preset}"


def main(argv=None):
    args = parse_args(argv)
    chosen = options.settle_defaults(args)  # --help and every flag error come before this line
    options.check_together(args)
    source = pretrained_source(args)
    import recipe_run as run  # the first import of kdist, JAX and Keras

    import kdist

    # isort: split
    import jax
    import keras

    run.start(args)
    if args.from_scratch:
        kdist.models.presets.preset_config(kdist.models.BERT_PRESETS, args.preset)
    output_dir = Path(args.output_dir)
    export_dir = Path(args.export_dir or output_dir / "hf")
    state = run.run_state(args, output_dir)
    if state.finished:
        return state.leave_alone(args)
    tokenizer, config, where = source_model(args, kdist, source)
    check_model_fits(args, config, tokenizer, where)
    cost = kdist.models.BertClassifier.cost_model_for(config)
    precision = run.prepare(args, state, cost, chosen)

    data = kdist.data.classification_dataset(
        args.task, tokenizer, args.sequence_length, args.global_batch_size // args.grad_accum,
        seed=args.seed, data_dir=args.data_dir, download=args.download,
    )
    for split in ("train", "validation"):
        kdist.data.check_token_ids(getattr(data, split).token_ids, config["vocabulary_size"],
                                   f"The encoded {split} examples of --task {args.task}")
    if args.init_from is not None:  # streamed into the sharded backbone
        backbone = kdist.models.BertBackbone.from_pretrained(
            args.init_from, dropout=args.dropout, remat=run.remat(args),
            attention_implementation=args.attention_implementation,
            matmul_precision=args.matmul_precision)
    else:
        backbone = kdist.models.BertBackbone(**{
            **config, "dropout": args.dropout, "remat": run.remat(args),
            "attention_implementation": args.attention_implementation,
            "matmul_precision": args.matmul_precision})
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
            gradient_accumulation_steps=args.grad_accum,
        )
    )
    callbacks, start_step = run.fit_callbacks(args, state, model, data.train)
    mesh = keras.distribution.distribution().spec
    print(f"task {data.task.name}: {data.num_classes} classes {data.class_names}, "
          f"{data.train_examples:,} training / {data.validation_examples:,} validation "
          f"examples; majority-class baseline {data.majority_baseline:.4f}")
    print(f"mesh {mesh} over {jax.device_count()} {jax.default_backend()} devices, "
          f"{precision}, {model.count_params():,} parameters")

    before = model.evaluate(data.validation, verbose=0, return_dict=True)["loss"]
    callbacks[0].record_validation({"loss": before}, step=start_step)  # the report's first point
    print(f"validation loss before fine-tuning: {before:.4f}")
    start = time.time()
    history = model.fit(
        data.train,
        validation_data=data.validation,
        epochs=args.steps // args.eval_every,
        steps_per_epoch=args.eval_every * args.grad_accum,
        shuffle=False,
        callbacks=callbacks,
    )
    wall = time.time() - start
    origin = args.init_from or (str(source) if source else None)
    accuracy = history.history["val_accuracy"][-1]
    print(f"held-out accuracy {accuracy:.4f} vs majority-class baseline "
          f"{data.majority_baseline:.4f} ({'pretrained' if origin else 'from scratch'}, "
          f"steps {start_step + 1}-{args.steps} in {wall:.0f} s)")
    # Every process joins the export's gathers; it carries the tokenizer and label names.
    model.save_pretrained(export_dir, tokenizer=tokenizer, label_names=data.class_names)
    summary = dict(
        run.flag_values(args), mesh=mesh, precision=precision, wall_seconds=wall,
        resumed_from_step=start_step, initialised_from=origin or "scratch", accuracy=accuracy,
        validation_loss_before=before,
        majority_baseline=data.majority_baseline, class_names=data.class_names,
        train_examples=data.train_examples, validation_examples=data.validation_examples,
        history=history.history, export_dir=str(export_dir),
    )
    if jax.process_count() > 1:
        return summary
    model.save(output_dir / "model.keras")
    tokenizer.save_assets(str(output_dir))  # vocabulary.txt, for kdist.hf.export_saved
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(f"outputs written to {output_dir.resolve()}: model.keras, vocabulary.txt, log.csv, "
          f"summary.json, throughput.jsonl; Hugging Face classifier in {export_dir.resolve()}")
    return summary


if __name__ == "__main__":
    options.command(main)
