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
    python recipes/bert_pretrain.py --mesh stage=2,fsdp=4 --gradient-reduction float32
The mesh, checkpoint and schedule flags are gpt_pretrain.py's (recipes/recipe_options.py):
running the same command again resumes exactly; a finished run is left alone.
"""

import json
import math
import sys
import time
from pathlib import Path

import recipe_options as options
from recipe_flags import (
    check_sequence_length,
    existing_path,
    int_at_least,
    positive_int,
    preset,
    probability,
    text_data,
    text_encoding,
)


def build_parser():
    """Every flag, its type (a bad value fails here, naming the flag) and default."""
    p = options.recipe_parser(__doc__)
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", default="bert-tiny", type=preset("BERT_PRESETS"),
                   help="see kdist.models.BERT_PRESETS")
    g.add_argument("--data", default="python-stdlib", type=text_data(),
                   help="python-stdlib or a text file/dir/glob")
    g.add_argument("--encoding", type=text_encoding(), default="utf-8",
                   help="of local text files (e.g. latin-1)")
    g.add_argument("--vocabulary", default=None,
                   type=existing_path("--vocabulary", "WordPiece vocabulary.txt"),
                   help="a WordPiece vocabulary.txt (None: train one on the corpus)")
    g.add_argument("--vocabulary-size", default=8192,
                   type=int_at_least("--vocabulary-size", 256,
                                     "special tokens and the corpus's characters"),
                   help="when training one")
    g.add_argument("--sequence-length", default=128,
                   type=int_at_least("--sequence-length", 8, "[CLS] A [SEP] B [SEP]"),
                   help="tokens per sequence, at most the preset's positions")
    g.add_argument("--mask-rate", type=probability("--mask-rate", 0.15, zero=False),
                   default=0.15, help="share of tokens selected, in (0, 1)")
    g.add_argument("--dropout", type=probability("--dropout", 0.1), default=0.0,
                   help="in [0, 1)")
    g.add_argument("--eval-steps", type=positive_int("--eval-steps", 8), default=None,
                   help="validation batches, evenly strided over the validation split "
                        "(None: the whole split)")
    options.add_shared_flags(p, output_dir="runs/bert_pretrain", log_every=20, steps=300,
                             learning_rate=1e-3, warmup_steps=30, eval_every=100,
                             weight_decay=0.01, global_batch_size=32)
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def accuracy_text(metrics, before=None):
    """', masked-token accuracy A (before B)', or '' where the model reports none (under
    --pipeline-schedule 1f1b the loss is computed inside the schedule, without logits)."""
    if "masked_accuracy" not in metrics:
        return ""
    text = f", masked-token accuracy {metrics['masked_accuracy']:.4f}"
    return text + (f" (before {before['masked_accuracy']:.4f})" if before else "")


def show_predictions(model, data, count=8):
    """Original, masked input and prediction at the first masked positions of one row."""
    import numpy as np

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
    chosen = options.settle_defaults(args)  # --help and every flag error come before this line
    options.check_together(args)
    import recipe_run as run  # the first import of kdist, JAX and Keras

    import kdist
    from kdist.cli import as_typed

    # isort: split
    import jax
    import keras

    run.start(args)
    config = kdist.models.presets.preset_config(kdist.models.BERT_PRESETS, args.preset,
                                                vocabulary_size=args.vocabulary_size)
    check_sequence_length(args, config["max_sequence_length"], f"--preset {args.preset}")
    output_dir = Path(args.output_dir)
    state = run.run_state(args, output_dir)
    if state.finished:
        return state.leave_alone(args)
    cost = kdist.models.BertMaskedLM.cost_model_for(config)
    precision = run.prepare(args, state, cost, chosen)

    data = kdist.data.mlm_dataset(
        args.data,
        sequence_length=args.sequence_length,
        global_batch_size=args.global_batch_size // args.grad_accum,
        vocabulary_size=args.vocabulary_size,
        vocabulary=args.vocabulary,
        seed=args.seed,
        validation_steps=args.eval_steps,
        mask_selection_rate=args.mask_rate,
        encoding=args.encoding,
    )
    model = kdist.models.BertMaskedLM.from_preset(
        args.preset, vocabulary_size=data.vocabulary_size, dropout=args.dropout,
        remat=run.remat(args), attention_implementation=args.attention_implementation,
        matmul_precision=args.matmul_precision)
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
    flops = model.cost_model_for(  # the MLM head at the masked positions actually trained
        model.backbone.get_config(), masked_positions=data.mask_selection_length,
    ).flops_per_token(args.sequence_length)
    callbacks, start_step = run.fit_callbacks(args, state, model, data.train,
                                              flops_per_token=flops.training)
    mesh = keras.distribution.distribution().spec
    print(f"mesh {mesh} over {jax.device_count()} {jax.default_backend()} devices, "
          f"{precision}, {model.count_params():,} parameters, "
          f"{data.train_sequences:,} training sequences of {args.sequence_length} tokens, "
          f"{data.mask_selection_length} masked slots per sequence")

    print(f"validation on {data.validation_coverage}")
    start = time.time()
    before = model.evaluate(data.validation, verbose=0, return_dict=True)
    callbacks[0].record_validation(before, step=start_step)  # the report's first point
    print(f"before training: validation loss {before['loss']:.4f} (uniform over the "
          f"vocabulary: {math.log(data.vocabulary_size):.4f}){accuracy_text(before)}")
    history = model.fit(
        data.train,
        validation_data=data.validation,
        epochs=args.steps // args.eval_every,
        steps_per_epoch=args.eval_every * args.grad_accum,
        shuffle=False,  # batches come shuffled (and freshly masked) from the dataset
        callbacks=callbacks,
    )
    wall = time.time() - start
    after = {name[len("val_"):]: values[-1] for name, values in history.history.items()
             if name.startswith("val_")}
    tokens = run.trained_tokens(args, start_step)
    print(f"after training: validation loss {after['loss']:.4f} (before {before['loss']:.4f})"
          f"{accuracy_text(after, before)}; {tokens:,} tokens (steps "
          f"{start_step + 1}-{args.steps}) in {wall:.0f} s")
    summary = dict(
        run.flag_values(args), mesh=mesh, precision=precision, tokens=tokens,
        wall_seconds=wall, resumed_from_step=start_step,
        validation_loss_before=before["loss"], validation_loss_after=after["loss"],
        masked_accuracy_before=before.get("masked_accuracy"),
        masked_accuracy_after=after.get("masked_accuracy"),
        flops_per_token=flops.as_dict(), history=history.history,
        backbone_config=model.backbone.get_config(),
    )
    if jax.process_count() > 1:  # model.save() needs every weight in one process
        print(f"{jax.process_count()} processes: no model.keras (single-process only for "
              f"now); logs in {output_dir.resolve()}")
        return summary
    print("masked predictions on a validation sequence:\n" + show_predictions(model, data))
    model.save(output_dir / "model.keras")
    data.tokenizer.save_assets(str(output_dir))  # vocabulary.txt
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(f"outputs written to {output_dir.resolve()}: model.keras, vocabulary.txt, log.csv, "
          f"summary.json, throughput.jsonl, tensorboard/ (fine-tune: "
          f"{as_typed(Path(sys.executable))} recipes/bert_finetune.py --pretrained "
          f"{output_dir})")
    return summary


if __name__ == "__main__":
    options.command(main)
