"""Writers for safetensors test inputs: real small files and sparse large ones.

Small files are written by the ``safetensors`` library itself (numpy API), so the
parser is tested against the reference writer. Large files (the published drafters'
shapes, multi-GB checkpoints) get a real header and a data buffer that is a hole in
a sparse file: their size is real, their disk use is nearly nothing.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I8": 1, "U8": 1}


def dflash_shapes(
    hidden: int,
    layers: int,
    heads: int,
    kv: int,
    head_dim: int,
    inter: int,
    taps: int,
    bias: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a DFlash drafter checkpoint (z-lab layout)."""
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, taps * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = (hidden,)
        out[p + "post_attention_layernorm.weight"] = (hidden,)
        out[p + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        out[p + "self_attn.k_proj.weight"] = (kv * head_dim, hidden)
        out[p + "self_attn.v_proj.weight"] = (kv * head_dim, hidden)
        out[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        out[p + "self_attn.q_norm.weight"] = (head_dim,)
        out[p + "self_attn.k_norm.weight"] = (head_dim,)
        out[p + "mlp.gate_proj.weight"] = (inter, hidden)
        out[p + "mlp.up_proj.weight"] = (inter, hidden)
        out[p + "mlp.down_proj.weight"] = (hidden, inter)
        if bias:
            out[p + "self_attn.q_proj.bias"] = (heads * head_dim,)
            out[p + "self_attn.k_proj.bias"] = (kv * head_dim,)
            out[p + "self_attn.v_proj.bias"] = (kv * head_dim,)
    return out


# The published drafters' shapes (hidden, layers, heads, kv, head_dim, intermediate, taps).
QWEN3_8B_DFLASH = dflash_shapes(4096, 5, 32, 8, 128, 12288, 5)
QWEN36_27B_DFLASH = dflash_shapes(5120, 5, 32, 8, 128, 17408, 5)


def write_real(path: Path, shapes: Mapping[str, Sequence[int]], dtype: str = "float16", seed: int = 0) -> Path:
    """A real safetensors file written by the safetensors library, random contents."""
    rng = np.random.default_rng(seed)
    arrays = {name: rng.standard_normal(tuple(shape)).astype(dtype) for name, shape in shapes.items()}
    save_file(arrays, str(path), metadata={"format": "pt"})
    return path


def header_bytes(shapes: Mapping[str, Sequence[int]], dtype: str = "BF16") -> tuple[bytes, int]:
    """(header JSON padded to 8 bytes, data length) laid out like the reference writer: sorted names."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(shapes):
        n = 1
        for d in shapes[name]:
            n *= d
        size = n * BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, offset


def write_sparse(path: Path, shapes: Mapping[str, Sequence[int]], dtype: str = "BF16") -> Path:
    """A full-size safetensors file whose data buffer is a hole (real header, zero data, no disk use)."""
    raw, data_len = header_bytes(shapes, dtype)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        fh.truncate(8 + len(raw) + data_len)
    return path


def write_raw(path: Path, header: bytes, data_len: int = 0, length: int | None = None) -> Path:
    """A file with an arbitrary header (hostile inputs): length prefix, header bytes, zero data."""
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header) if length is None else length))
        fh.write(header)
        fh.write(b"\0" * data_len)
    return path


def write_sharded(
    directory: Path,
    shapes: Mapping[str, Sequence[int]],
    shards: int,
    dtype: str = "BF16",
    sparse: bool = True,
) -> Path:
    """Shards plus model.safetensors.index.json, tensors dealt to shards in sorted order."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(shapes)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        part = {n: shapes[n] for n in names[s * per : (s + 1) * per]}
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        if sparse:
            write_sparse(directory / fname, part, dtype)
        else:
            write_real(directory / fname, part, seed=s)
        for n in part:
            weight_map[n] = fname
        total += header_bytes(part, dtype)[1]
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return directory


def disk_bytes(path: os.PathLike[str]) -> int:
    return os.stat(path).st_blocks * 512


def fake(name: str):
    """A test double from tests/fakes/ (where doubles live; it is not a package), loaded by its path with
    the repository's one importer for such files (ddtree.repo.repo_file). The fakes run as scripts beside
    each other and import target_model by name, so it is loaded first. (Imported here, not at the top:
    benchmarks/safetensors_inspect.py runs this file's writers where the package ddtree is not importable.)"""
    from ddtree.repo import repo_file

    repo_file("tests/fakes/target_model.py")
    return repo_file(f"tests/fakes/{name}.py")
