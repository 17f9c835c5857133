#!/usr/bin/env python3
"""Test double for the target checkpoint a GPU node serves (Qwen3.6-27B, about 55.6 GB in bf16).

It writes what the deployment reads of a target directory, at the real model's configuration:
config.json shaped like Qwen3.6-27B's (text settings nested under text_config), the tokenizer
files (248044 base tokens plus 26 added ones, so the first free id is 248070 as for the real
tokenizer), and two safetensors shards with a model.safetensors.index.json naming them. The
shards hold tiny placeholder tensors: the lab never runs the model, it checks the layout.

Usage: target_model.py DEST_DIR   (standard library only; idempotent: same bytes every time)
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

BASE_VOCAB = 248044
ADDED_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
NUM_LAYERS = 64


def layer_types() -> list[str]:
    # Gated DeltaNet (linear attention) x3, then one gated full-attention layer: 3, 7, ..., 63.
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(NUM_LAYERS)]


def config() -> dict:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": 248056,
        "video_token_id": 248057,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "layer_types": layer_types(),
            "hidden_act": "silu",
            "rms_norm_eps": 1e-06,
            "max_position_embeddings": 262144,
            "vocab_size": 248320,
            "attention_bias": False,
            "attn_output_gate": True,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_interleaved": True,
                "mrope_section": [11, 11, 10],
            },
            "dtype": "bfloat16",
            "eos_token_id": 248046,
            "mtp_num_hidden_layers": 1,
        },
        "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "out_hidden_size": 5120},
    }


def tokenizer_json() -> dict:
    vocab = {f"t{i}": i for i in range(BASE_VOCAB)}
    added = [
        {
            "id": BASE_VOCAB + i,
            "content": tok,
            "special": True,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
        }
        for i, tok in enumerate(ADDED_TOKENS)
    ]
    return {"version": "1.0", "added_tokens": added, "model": {"type": "BPE", "vocab": vocab, "merges": []}}


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 262144,
        "added_tokens_decoder": {
            str(BASE_VOCAB + i): {"content": tok, "special": True} for i, tok in enumerate(ADDED_TOKENS)
        },
    }


def safetensors_bytes(tensors: dict[str, list[int]]) -> bytes:
    """A valid bf16 safetensors file with zeroed placeholder tensors of the given shapes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = 2
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


SHARDS = {
    "model-00001-of-00002.safetensors": {
        "model.language_model.embed_tokens.weight": [8, 8],
        "model.language_model.layers.0.input_layernorm.weight": [8],
    },
    "model-00002-of-00002.safetensors": {
        "model.language_model.norm.weight": [8],
        "lm_head.weight": [8, 8],
    },
}


def write(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": json.dumps(config(), indent=2, sort_keys=True) + "\n",
        "tokenizer.json": json.dumps(tokenizer_json(), separators=(",", ":")) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n",
        "generation_config.json": json.dumps({"eos_token_id": [248046, 248044]}, indent=2) + "\n",
    }
    for name, text in files.items():
        (dest / name).write_text(text)
    weight_map = {}
    total = 0
    for shard, tensors in SHARDS.items():
        data = safetensors_bytes(tensors)
        (dest / shard).write_bytes(data)
        # total_size counts the tensors' bytes (as transformers writes it), not the files'
        total += sum(2 * math.prod(shape) for shape in tensors.values())
        weight_map.update(dict.fromkeys(tensors, shard))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: target_model.py DEST_DIR")
    write(Path(sys.argv[1]))
