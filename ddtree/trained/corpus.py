"""The trained pairs' text: Python sources that ship with the machine's installed packages.

Deterministic from the machine's files: every ``.py`` file under the interpreter's package
directories (anything under /tmp is left out: that is where a GPU session unpacks vLLM), keyed by
its path inside its package directory, duplicates by path or content dropped, sorted. A file is
held out when the first byte of the SHA-256 of that path is below ``HELD_OUT_BELOW`` (about 5%), so
a prompt never comes from a file the target was trained on. The corpus digest covers every kept
path and its content digest: two machines with the same digest trained on the same text.

The tokenizer is a byte-level BPE of ``VOCAB_TEXT`` tokens trained by the ``tokenizers`` library on
the training split; id 0 is ``<|endoftext|>`` (document separator). The DFlash mask token is the
first id past the text tokens (``VOCAB_TEXT``), as 248070 is for Qwen3.6; the models' vocabulary is
padded past it to a multiple of 64, as Qwen pads its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VOCAB_TEXT = 4096  # text tokens (ids 0..4095); the mask token is 4096
MASK_TOKEN_ID = VOCAB_TEXT
VOCAB_SIZE = VOCAB_TEXT + 64  # embedding rows: the mask row and padding, a multiple of 64
EOS = "<|endoftext|>"
HELD_OUT_BELOW = 13  # first byte of sha256(path) < 13: 13/256 = 5.1% of the files
MIN_BYTES, MAX_BYTES = 512, 256 * 1024
TOKENIZER_SAMPLE_BYTES = 24 << 20  # BPE merges learnt on the first 24 MB of the training split


@dataclass(frozen=True)
class SourceFile:
    path: str  # inside its package directory, e.g. "torch/nn/modules/linear.py"
    location: str  # where it was read
    sha256: str
    held_out: bool


def package_dirs() -> list[str]:
    """The interpreter's package directories, in a fixed order, without anything under /tmp."""
    found = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    found += ["/usr/lib/python3/dist-packages"]
    out: list[str] = []
    for d in found:
        real = os.path.realpath(d)
        if os.path.isdir(real) and not real.startswith("/tmp") and real not in out:
            out.append(real)
    return out


def _held_out(path: str) -> bool:
    return hashlib.sha256(path.encode()).digest()[0] < HELD_OUT_BELOW


def list_sources(dirs: list[str] | None = None) -> list[SourceFile]:
    """Every usable .py file once, sorted by its path inside its package directory."""
    seen_paths: set[str] = set()
    seen_content: set[str] = set()
    files: list[SourceFile] = []
    for root in dirs if dirs is not None else package_dirs():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                try:
                    if os.path.islink(full) or not MIN_BYTES <= os.path.getsize(full) <= MAX_BYTES:
                        continue
                    data = Path(full).read_bytes()
                    data.decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                digest = hashlib.sha256(data).hexdigest()
                if rel in seen_paths or digest in seen_content:
                    continue
                seen_paths.add(rel)
                seen_content.add(digest)
                files.append(SourceFile(rel, full, digest, _held_out(rel)))
    files.sort(key=lambda f: f.path)
    return files


def corpus_digest(files: list[SourceFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.path}\0{f.sha256}\n".encode())
    return h.hexdigest()


def read_texts(files: list[SourceFile], limit_bytes: int | None = None) -> Iterator[str]:
    """The files' texts in order, up to ``limit_bytes`` in all."""
    total = 0
    for f in files:
        text = Path(f.location).read_text(encoding="utf-8")
        total += len(text)
        if limit_bytes is not None and total > limit_bytes:
            return
        yield text


def train_tokenizer(files: list[SourceFile], out_dir: str) -> str:
    """A byte-level BPE of VOCAB_TEXT tokens learnt on the training split; returns tokenizer.json's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TEXT,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    train = [f for f in files if not f.held_out]
    tok.train_from_iterator(read_texts(train, TOKENIZER_SAMPLE_BYTES), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_TEXT:
        raise RuntimeError(f"the tokenizer learnt {tok.get_vocab_size()} tokens, not {VOCAB_TEXT}: too little text")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    write_tokenizer_config(out_dir)
    return path


def write_tokenizer_config(out_dir: str) -> None:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def encode(tokenizer_path: str, files: list[SourceFile], limit_bytes: int | None = None) -> list[list[int]]:
    """Token ids of each file (in batches: the library encodes them on every core)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    out: list[list[int]] = []
    batch: list[str] = []
    for text in read_texts(files, limit_bytes):
        batch.append(text)
        if len(batch) == 256:
            out += [e.ids for e in tok.encode_batch(batch)]
            batch = []
    if batch:
        out += [e.ids for e in tok.encode_batch(batch)]
    return out


def token_stream(docs: list[list[int]]) -> list[int]:
    """Documents joined by the separator (id 0), one after another."""
    stream: list[int] = []
    for ids in docs:
        stream += ids
        stream.append(0)
    return stream
