"""Test double for target model directories (Qwen3.6-27B, Qwen3-8B, a tiny Qwen3): config.json and tokenizer only.

What the DFlash config builder reads of a target: config.json (Qwen3.6-27B nests its text
settings under ``text_config``; Qwen3-8B is flat) and the tokenizer files. Qwen3.6-27B is the
lab's own double (target_model.py). The Qwen3-8B tokenizer holds its real base vocabulary size
and 26 added special tokens after it, so the first free id is the published mask token id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import target_model


def _tokenizer(base: int, added: int) -> dict[str, Any]:
    return {
        "version": "1.0",
        "added_tokens": [{"id": base + i, "content": f"<|special_{i}|>", "special": True} for i in range(added)],
        "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(base)}, "merges": []},
    }


def write_target(directory: Path, config: dict[str, Any], tokenizer: dict[str, Any] | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


# The lab double's config.json (text settings under text_config).
QWEN36_27B_CONFIG: dict[str, Any] = target_model.config()

QWEN3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def qwen36_27b(directory: Path) -> Path:
    """The lab's Qwen3.6-27B double: 248044 base tokens + 26 added, the first free id is 248070."""
    target_model.write(directory)
    return directory


def qwen3_8b(directory: Path) -> Path:
    """151643 base tokens + 26 added: the first free id is 151669."""
    return write_target(directory, QWEN3_8B_CONFIG, _tokenizer(151643, 26))


def tiny(directory: Path, hidden: int = 64, layers: int = 8, vocab: int = 1000, tokens: int = 990) -> Path:
    """A small flat target with ``tokens`` tokens (base + 10 added)."""
    cfg = {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-06,
    }
    return write_target(directory, cfg, _tokenizer(tokens - 10, 10))
