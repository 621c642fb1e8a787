"""The fine-tuning recipes from Hugging Face checkpoints, end to end and small: one written
by the tests' generator, one exported from a kdist pretraining run."""

import json
import sys
from pathlib import Path

import pytest
from tokenizers import ByteLevelBPETokenizer

import kdist
from tests.helpers import RECIPES, run_recipe
from tests.models.hf_fixtures import write_checkpoint

sys.path.insert(0, str(RECIPES))
import bert_finetune  # noqa: E402
import gpt_finetune  # noqa: E402
import gpt_pretrain  # noqa: E402

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 13} + {i % 7}\n\n" for i in range(3000))
FLAGS = ["--steps", "8", "--eval-every", "4", "--eval-steps", "2", "--global-batch-size", "8",
         "--sequence-length", "32", "--warmup-steps", "2", "--learning-rate", "3e-3",
         "--log-every", "4", "--mesh", "fsdp=4,model=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    for k in range(8):  # alike documents: the validation file is like the training ones
        (root / f"doc{k}.py").write_text(TEXT[k * 12000:(k + 1) * 12000])
    return root


def gpt2_with_tokenizer(directory: Path) -> Path:
    """A random GPT-2 checkpoint with a 300-entry byte-level BPE of its own."""
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator([TEXT], vocab_size=300, special_tokens=["<|endoftext|>"],
                                  show_progress=False)
    write_checkpoint(directory, "gpt2", n_positions=64)
    tokenizer.save_model(str(directory))
    return directory


@pytest.mark.slow
def test_finetunes_a_generated_checkpoint(tmp_path, corpus):
    source = gpt2_with_tokenizer(tmp_path / "gpt2")
    summary = gpt_finetune.main(FLAGS + ["--init-from", str(source), "--data", str(corpus),
                                         "--output-dir", str(tmp_path / "run")])
    assert summary["validation_loss_after"] < summary["validation_loss_before"] - 0.5
    # The fine-tuned model went out in HF format with its tokenizer, and reads back.
    export = tmp_path / "run" / "hf"
    assert json.loads((export / "config.json").read_text())["model_type"] == "gpt2"
    assert (export / "vocab.json").exists() and (export / "tokenizer.json").exists()
    tokenizer = kdist.hf.load_tokenizer(export)
    assert tokenizer.vocabulary_size() == 300
    assert (tmp_path / "run" / "checkpoints").is_dir()
    rows = [json.loads(line) for line in (tmp_path / "run" / "throughput.jsonl").open()]
    assert [r["step"] for r in rows if r["kind"] == "interval"] == [4, 8]


@pytest.mark.slow
def test_finetunes_a_checkpoint_exported_from_a_kdist_pretraining_run(tmp_path, corpus):
    pretrain = gpt_pretrain.main(
        FLAGS + ["--data", str(corpus), "--vocabulary-size", "512", "--sample-length", "4",
                 "--output-dir", str(tmp_path / "pretrain")])
    assert pretrain["validation_loss_after"] < pretrain["validation_loss_before"]
    kdist.hf.export_saved(tmp_path / "pretrain", tmp_path / "hf")
    summary = gpt_finetune.main(FLAGS + ["--init-from", str(tmp_path / "hf"), "--data",
                                         str(corpus), "--learning-rate", "5e-4",
                                         "--seed", "1",  # batches pretraining did not see
                                         "--output-dir", str(tmp_path / "run")])
    # Fine-tuning starts where pretraining ended (same weights, tokenizer and data) ...
    assert abs(summary["validation_loss_before"] - pretrain["validation_loss_after"]) < 0.05
    assert summary["validation_loss_after"] < summary["validation_loss_before"]


@pytest.mark.slow
def test_bert_finetune_from_a_hugging_face_directory(tmp_path):
    # An HF-initialised (std 0.02) BERT with a cased WordPiece vocabulary of the corpus.
    tokenizer = kdist.data.word_piece_tokenizer(kdist.data.load_corpus(), 1024)
    vocabulary = list(tokenizer.get_vocabulary())
    write_checkpoint(tmp_path / "bert", "bert", vocab_size=len(vocabulary),
                     max_position_embeddings=64, scale=0.02)
    (tmp_path / "bert" / "vocab.txt").write_text("\n".join(vocabulary) + "\n")
    (tmp_path / "bert" / "tokenizer_config.json").write_text('{"do_lower_case": false}')
    summary, _ = run_recipe("bert_finetune", [
        "--init-from", str(tmp_path / "bert"), "--steps", "200", "--eval-every", "100",
        "--global-batch-size", "16", "--sequence-length", "64", "--warmup-steps", "20",
        "--learning-rate", "1e-3", "--mesh", "fsdp=8", "--output-dir", str(tmp_path / "run")])
    losses = summary["history"]["val_loss"]
    assert summary["initialised_from"] == str(tmp_path / "bert")
    assert losses[-1] < summary["validation_loss_before"] - 0.1, losses  # 1.79 -> 1.60 here
    assert summary["accuracy"] > summary["majority_baseline"] + 0.05


def test_flags_and_directories_are_checked_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpt_finetune.main(["--init-from", str(tmp_path / "nowhere")])
    assert "--init-from" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--init-from .* has no config.json"):
        gpt_finetune.main(["--init-from", str(tmp_path)])
    write_checkpoint(tmp_path / "bert", "bert")
    with pytest.raises(ValueError, match="is a BERT checkpoint; fine-tune it with "
                                         "recipes/bert_finetune.py"):
        gpt_finetune.main(["--init-from", str(tmp_path / "bert")])
    write_checkpoint(tmp_path / "gpt2", "gpt2")
    with pytest.raises(ValueError, match="--sequence-length 256 exceeds the 32 positions"):
        gpt_finetune.main(["--init-from", str(tmp_path / "gpt2"), "--sequence-length", "256"])
    with pytest.raises(ValueError, match="Pass either --init-from DIR, --pretrained DIR or "
                                         "--from-scratch"):
        bert_finetune.main(["--init-from", str(tmp_path / "bert"), "--from-scratch"])
