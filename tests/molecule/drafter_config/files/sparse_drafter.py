#!/usr/bin/env python3
"""Write a full-size (3.46 GB) Qwen3.6-27B-DFlash-shaped drafter whose data is a hole in a sparse file.

The header is real (every tensor of the published drafter, BF16); the data buffer takes no disk.
Standard library only, so it runs on a lab node. Usage: sparse_drafter.py DEST_FILE
"""

from __future__ import annotations

import json
import struct
import sys

H, LAYERS, HEADS, KV, HD, INTER, TAPS = 5120, 5, 32, 8, 128, 17408, 5


def shapes() -> dict[str, list[int]]:
    out = {"fc.weight": [H, TAPS * H], "hidden_norm.weight": [H], "norm.weight": [H]}
    for i in range(LAYERS):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm.weight": [H],
            p + "post_attention_layernorm.weight": [H],
            p + "self_attn.q_proj.weight": [HEADS * HD, H],
            p + "self_attn.k_proj.weight": [KV * HD, H],
            p + "self_attn.v_proj.weight": [KV * HD, H],
            p + "self_attn.o_proj.weight": [H, HEADS * HD],
            p + "self_attn.q_norm.weight": [HD],
            p + "self_attn.k_norm.weight": [HD],
            p + "mlp.gate_proj.weight": [INTER, H],
            p + "mlp.up_proj.weight": [INTER, H],
            p + "mlp.down_proj.weight": [H, INTER],
        }
    return out


def main(dest: str) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in sorted(shapes().items()):
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dest, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: sparse_drafter.py DEST_FILE")
    main(sys.argv[1])
