"""Corpora, tokenizers and deterministic batches."""

from kdist.data.corpus import STDLIB, Corpus, load_corpus
from kdist.data.lm import LMBatches, LMData, lm_dataset, token_store
from kdist.data.tokenizer import END_OF_TEXT, byte_pair_tokenizer

__all__ = [
    "END_OF_TEXT", "STDLIB", "Corpus", "LMBatches", "LMData", "byte_pair_tokenizer",
    "lm_dataset", "load_corpus", "token_store",
]
