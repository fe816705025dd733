"""Data pipeline: tokenizers, validated jsonl, pretraining (megatron-core indexed/GPT datasets), chat SFT, packing.

Modules: tokenizer, jsonl (validated reading), preprocess (jsonl -> .bin/.idx), index_cache (jsonl prefixes
preprocessed once), blend (prefix/weight lists), dataset_helpers (megatron-core's C++ helpers), pretrain_datasets
(GPTDataset splits), sft (chat samples), packing.

::

    from megatron_glm5.data import load_tokenizer, preprocess_jsonl, build_pretrain_datasets
    from megatron_glm5.data import SFTDataset, pack_sequences, collate_padded, make_packed_seq_params

    tok = load_tokenizer("tiny")                                # or an HF dir / sentencepiece .model
    preprocess_jsonl("a.jsonl", "out/a", tok, append_eod=True)  # -> out/a.bin + out/a.idx
    train, valid, test = build_pretrain_datasets([("out/a", 0.8), ("out/b", 0.2)], "98,1,1", seq_length=128,
                                                 num_samples=(1000, 50, 50), tokenizer=tok)
    sft = SFTDataset(TINY_CHAT_TRAIN, tok, seq_length=128, packed=True)
    batches = pack_sequences(sft, seq_length=128, pad_id=tok.pad_id)

Shipped tiny assets: ``TINY_CHAT_TRAIN`` / ``TINY_CHAT_VALID`` (chat SFT jsonl), ``TINY_PRETRAIN_A`` /
``TINY_PRETRAIN_B`` (pretraining jsonl, key ``text``), and the tokenizer ``load_tokenizer("tiny")``.
"""
import os as _os

from megatron_glm5.data.jsonl import DataError, JsonlStats, iter_jsonl, parse_jsonl_line, read_jsonl
from megatron_glm5.data.packing import collate_padded, concat_packed, make_packed_seq_params, pack_sequences
from megatron_glm5.data.blend import normalize_blend
from megatron_glm5.data.dataset_helpers import ensure_helpers
from megatron_glm5.data.index_cache import ensure_indexed
from megatron_glm5.data.preprocess import PreprocessResult, prefix_is_complete, preprocess_jsonl
from megatron_glm5.data.pretrain_datasets import build_pretrain_datasets
from megatron_glm5.data.sft import SFTDataset, SFTStats, tokenize_chat, validate_chat_record
from megatron_glm5.data.tokenizer import (ChatTemplateError, GLM5Tokenizer, TokenizerNotFoundError, load_tokenizer,
                                          ASSETS_DIR, TINY_TOKENIZER_DIR)

TINY_DATA_DIR = _os.path.join(ASSETS_DIR, "data")
TINY_CHAT_TRAIN = _os.path.join(TINY_DATA_DIR, "chat_train.jsonl")
TINY_CHAT_VALID = _os.path.join(TINY_DATA_DIR, "chat_valid.jsonl")
TINY_PRETRAIN_A = _os.path.join(TINY_DATA_DIR, "pretrain_a.jsonl")
TINY_PRETRAIN_B = _os.path.join(TINY_DATA_DIR, "pretrain_b.jsonl")

__all__ = [
    "DataError", "JsonlStats", "iter_jsonl", "read_jsonl", "parse_jsonl_line",
    "GLM5Tokenizer", "load_tokenizer", "TokenizerNotFoundError", "ChatTemplateError",
    "PreprocessResult", "preprocess_jsonl", "prefix_is_complete", "normalize_blend", "build_pretrain_datasets",
    "ensure_helpers", "ensure_indexed",
    "SFTDataset", "SFTStats", "tokenize_chat", "validate_chat_record",
    "pack_sequences", "concat_packed", "collate_padded", "make_packed_seq_params",
    "ASSETS_DIR", "TINY_TOKENIZER_DIR", "TINY_DATA_DIR", "TINY_CHAT_TRAIN", "TINY_CHAT_VALID", "TINY_PRETRAIN_A",
    "TINY_PRETRAIN_B",
]
