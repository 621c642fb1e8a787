"""Corpora, tokenizers and deterministic batches (a pure function of seed, step, process).

==================  =========================================================================
``corpus``          the embedded corpus (the Python standard library's source), local text
``sources``         text streamed by document: the corpus, local files, TFDS
``tokenizer``       byte-pair tokenizers (trained with Hugging Face ``tokenizers``)
``wordpiece``       BERT's WordPiece vocabulary
``token_store``     token ids on disk, memory-mapped
``lm``              language-model batches
``mlm``             BERT's packing and masking
``classification``  sequence-classification batches
``sampling``        which examples a process reads at a global step
``checks``          token-id range checks
==================  ========================================================================="""

from kdist.data.checks import check_token_ids, decode_text
from kdist.data.classification import (
    ClassificationBatches,
    ClassificationData,
    TextClassificationTask,
    classification_dataset,
    stdlib_package_task,
    tfds_task,
)
from kdist.data.corpus import STDLIB, Corpus, load_corpus
from kdist.data.lm import LMBatches, LMData, lm_dataset
from kdist.data.mlm import MLMBatches, MLMData, mlm_dataset, pack_segments
from kdist.data.token_store import token_store
from kdist.data.tokenizer import END_OF_TEXT, byte_pair_tokenizer
from kdist.data.wordpiece import load_word_piece, word_piece_tokenizer

__all__ = [
    "END_OF_TEXT", "STDLIB", "ClassificationBatches", "ClassificationData", "Corpus",
    "LMBatches", "LMData", "MLMBatches", "MLMData", "TextClassificationTask",
    "byte_pair_tokenizer", "check_token_ids", "classification_dataset", "decode_text",
    "lm_dataset", "load_corpus", "load_word_piece", "mlm_dataset", "pack_segments",
    "stdlib_package_task", "tfds_task",
    "token_store", "word_piece_tokenizer",
]
