"""Tokenizers of Hugging Face directories through keras-hub's classes, id for id against the
HF ``tokenizers`` library; and kdist's own tokenizers written out and read back."""

import json

import keras_hub
import pytest
import tokenizers
from tokenizers import ByteLevelBPETokenizer, Regex, decoders, models, pre_tokenizers, trainers

import kdist
from kdist.data.tokenizer import load_byte_pair, train_byte_pair
from kdist.data.wordpiece import train_word_piece

CORPUS = ["def f(x):\n    return x * 12345 + 7\n",
          "I'm sure they'll say naïve café costs 1000000 yen.\n\n  Spaces   here",
          "Hello World! The year 2024 was... 'quoted' YES; über-ÜBER"] * 40
TEXTS = ["x = 12345 + 678", "I'm naïve, they'll see.\n\n  two  spaces", "Hello World 2024!",
         "über ÜBER  \n"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def ids(tokenizer, text):
    return [int(i) for i in tokenizer.tokenize(text)]


def test_gpt2_vocab_and_merges_tokenize_like_gpt2(tmp_path):
    reference = ByteLevelBPETokenizer()  # GPT-2's pipeline: byte-level with GPT-2's regex
    reference.train_from_iterator(CORPUS, vocab_size=400, special_tokens=["<|endoftext|>"],
                                  show_progress=False)
    reference.save_model(str(tmp_path))  # vocab.json, merges.txt
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    tokenizer = kdist.hf.load_tokenizer(tmp_path)
    assert isinstance(tokenizer, keras_hub.tokenizers.GPT2Tokenizer)
    for text in TEXTS + ["<|endoftext|>after"]:
        assert ids(tokenizer, text) == reference.encode(text).ids, text
        assert tokenizer.detokenize(ids(tokenizer, text)) == text
    # Why kdist sets the pipeline: keras-hub's own splits like Llama 3, not GPT-2.
    plain = keras_hub.tokenizers.BytePairTokenizer(
        vocabulary=str(tmp_path / "vocab.json"), merges=str(tmp_path / "merges.txt"))
    assert any(ids(plain, t) != reference.encode(t).ids for t in TEXTS)


def llama3_tokenizer_json(directory):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "<|reserved_special_token_0|>"]
    backend = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return backend


def test_llama3_tokenizer_json(tmp_path):
    reference = llama3_tokenizer_json(tmp_path)
    tokenizer = kdist.hf.load_tokenizer(tmp_path)
    assert isinstance(tokenizer, keras_hub.tokenizers.Llama3Tokenizer)
    assert tokenizer.vocabulary_size() == reference.get_vocab_size()
    assert tokenizer.end_token_id == reference.token_to_id("<|end_of_text|>")
    for text in TEXTS + ["<|eot_id|>x"]:
        assert ids(tokenizer, text) == reference.encode(text).ids, text
        assert tokenizer.detokenize(ids(tokenizer, text)) == text
    # Written back (export) and read again: the same pipeline and special tokens.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    kdist.hf.save_tokenizer(tokenizer, tmp_path / "out", max_length=128)
    again = kdist.hf.load_tokenizer(tmp_path / "out")
    assert isinstance(again, keras_hub.tokenizers.Llama3Tokenizer)
    assert (again.start_token, again.end_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert all(ids(again, t) == ids(tokenizer, t) for t in TEXTS)


def test_bert_vocab_txt(tmp_path):
    trainer = tokenizers.BertWordPieceTokenizer(lowercase=True)
    trainer.train_from_iterator(CORPUS, vocab_size=300, show_progress=False)
    trainer.save_model(str(tmp_path))  # vocab.txt
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    reference = tokenizers.BertWordPieceTokenizer(str(tmp_path / "vocab.txt"), lowercase=True)
    tokenizer = kdist.hf.load_tokenizer(tmp_path)
    assert isinstance(tokenizer, keras_hub.tokenizers.BertTokenizer)
    for text in TEXTS:
        assert ids(tokenizer, text) == reference.encode(text, add_special_tokens=False).ids


def test_kdist_tokenizers_written_and_read_back(tmp_path):
    train_byte_pair(CORPUS, 400, tmp_path / "bpe")
    own = load_byte_pair(tmp_path / "bpe")
    names = kdist.hf.save_tokenizer(own, tmp_path / "bpe", max_length=64)
    assert "tokenizer.json" in names
    back = kdist.hf.load_tokenizer(tmp_path / "bpe")
    for text in TEXTS:
        assert ids(back, text) == ids(own, text), text
    train_word_piece(CORPUS, 300, tmp_path / "wp" / "vocabulary.txt")
    own = kdist.data.load_word_piece(tmp_path / "wp" / "vocabulary.txt")
    kdist.hf.save_tokenizer(own, tmp_path / "wp", max_length=64)  # vocab.txt, cased
    back = kdist.hf.load_tokenizer(tmp_path / "wp")
    assert isinstance(back, keras_hub.tokenizers.BertTokenizer) and not back.lowercase
    for text in TEXTS:
        assert ids(back, text) == ids(own, text), text


def test_missing_tokenizer_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="has no tokenizer files: expected tokenizer.json"):
        kdist.hf.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram"}}))
    with pytest.raises(ValueError, match="holds a 'Unigram' tokenizer"):
        kdist.hf.load_tokenizer(tmp_path)
    with pytest.raises(TypeError, match="Cannot write a ByteTokenizer"):
        kdist.hf.save_tokenizer(keras_hub.tokenizers.ByteTokenizer(), tmp_path, 8)
