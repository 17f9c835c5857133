#!/usr/bin/env python3
"""Test double for the DFlash drafter checkpoint (Qwen3.6-27B-DFlash, 3.46 GB): a small one the lab stages.

Hidden size 5120 (the target's), one draft layer tapping one target layer, 2 query heads and
1 KV head of 64, MLP width 64, float16: about 53 MB, real random weights in the z-lab layout.

Usage: drafter_model.py DEST_FILE
"""

from __future__ import annotations

import json
import struct
import sys

import numpy as np

H, HEADS, KV, HD, INTER = 5120, 2, 1, 64, 64


def shapes() -> dict[str, tuple[int, ...]]:
    p = "layers.0."
    return {
        "fc.weight": (H, H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (HEADS * HD, H),
        p + "self_attn.k_proj.weight": (KV * HD, H),
        p + "self_attn.v_proj.weight": (KV * HD, H),
        p + "self_attn.o_proj.weight": (H, HEADS * HD),
        p + "self_attn.q_norm.weight": (HD,),
        p + "self_attn.k_norm.weight": (HD,),
        p + "mlp.gate_proj.weight": (INTER, H),
        p + "mlp.up_proj.weight": (INTER, H),
        p + "mlp.down_proj.weight": (H, INTER),
    }


def main() -> None:
    rng = np.random.default_rng(0)
    tensors = {
        name: rng.standard_normal(shape, dtype=np.float32).astype(np.float16) for name, shape in shapes().items()
    }
    save_file(tensors, sys.argv[1], metadata={"format": "pt"})


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str]) -> None:
    """The safetensors layout as safetensors.numpy.save_file writes it (8-byte header length, JSON
    header padded with spaces to 8 bytes, tensors in name order), with numpy only: `make lab`
    installs the controller's requirements.txt, which has numpy but not safetensors."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        size = tensors[name].nbytes
        header[name] = {"dtype": "F16", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for name in sorted(tensors):
            fh.write(np.ascontiguousarray(tensors[name]).astype("<f2").tobytes())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: drafter_model.py DEST_FILE")
    main()
