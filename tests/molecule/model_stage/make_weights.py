#!/usr/bin/env python3
"""Write safetensors inputs for the model_stage scenario: same bytes every time for a given seed.

    make_weights.py file PATH MIB SEED [PREFIX] one file of MIB MiB of tensor data (streamed, seeded)
    make_weights.py sparse PATH MIB           a valid header and a MIB MiB hole (sparse: no disk used)
    make_weights.py shards DIR COUNT MIB SEED COUNT shards of MIB MiB each, no index
    make_weights.py flip PATH OFFSET          invert one byte in place (header stays valid)
    make_weights.py cut PATH BYTES            drop the last BYTES bytes (a truncated download)

Each file holds a BF16 ``fc.weight`` [rows, 1024] filling the data and a BF16 ``norm.weight`` [1024];
shard k names its tensors ``layers.k.*``. Standard library only.
"""

from __future__ import annotations

import json
import os
import random
import struct
import sys

ROW = 1024 * 2  # one BF16 row of 1024 elements
CHUNK = 8 * 1024 * 1024


def header(mib: int, prefix: str = "") -> tuple[bytes, int]:
    rows = mib * 1024 * 1024 // ROW - 1
    fc = rows * ROW
    meta = {
        "__metadata__": {"format": "pt"},
        f"{prefix}fc.weight": {"dtype": "BF16", "shape": [rows, 1024], "data_offsets": [0, fc]},
        f"{prefix}norm.weight": {"dtype": "BF16", "shape": [1024], "data_offsets": [fc, fc + ROW]},
    }
    raw = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, fc + ROW


def write_file(path: str, mib: int, seed: int, prefix: str = "") -> None:
    head, data = header(mib, prefix)
    rng = random.Random(seed)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(head)
        left = data
        while left:
            n = min(CHUNK, left)
            fh.write(rng.randbytes(n))
            left -= n
    os.replace(tmp, path)


def write_sparse(path: str, mib: int) -> None:
    head, data = header(mib)
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + data)


def main(argv: list[str]) -> int:
    cmd, *rest = argv
    if cmd == "file":
        write_file(rest[0], int(rest[1]), int(rest[2]), rest[3] if len(rest) > 3 else "")
    elif cmd == "sparse":
        write_sparse(rest[0], int(rest[1]))
    elif cmd == "shards":
        out, count, mib, seed = rest[0], int(rest[1]), int(rest[2]), int(rest[3])
        os.makedirs(out, exist_ok=True)
        for k in range(count):
            name = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
            write_file(os.path.join(out, name), mib, seed + k, prefix=f"layers.{k}.")
    elif cmd == "flip":
        with open(rest[0], "r+b") as fh:
            fh.seek(int(rest[1]))
            b = fh.read(1)
            fh.seek(int(rest[1]))
            fh.write(bytes([b[0] ^ 0xFF]))
    elif cmd == "cut":
        size = os.path.getsize(rest[0])
        os.truncate(rest[0], size - int(rest[1]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
