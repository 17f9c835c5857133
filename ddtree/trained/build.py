"""Build a trained pair: a small target trained on the machine's Python sources and its DFlash drafter
trained on that target's hidden states. Needs torch, transformers and tokenizers (no vLLM); a GPU
makes it take minutes (about 5 per pair on an H100).

    python3 -m ddtree.trained.build prepare DIR            # corpus, tokenizer, token streams (shared)
    python3 -m ddtree.trained.build pair hybrid DIR        # DIR/hybrid/{target,drafter,prompts.json,build.json}
    python3 -m ddtree.trained.build pair attention DIR     # DIR/attention/...

``prepare`` writes DIR/tokenizer/ and DIR/{train,held_out}.tokens (uint16) with DIR/corpus.json
(file counts, the corpus digest, the held-out rule). ``pair`` then, for one target kind:

1. trains the target (next-token loss on random windows of ``SEQ`` tokens of the training stream)
   and reports its held-out loss and mean top-1 probability on fixed held-out windows;
2. lets the target write on-policy text: continuations of ``GEN`` tokens from training-stream
   prefixes of 32 to 1400 tokens, half greedy, half sampled at temperature 0.7 with top-p 0.95 and
   top-k 20 (Qwen's recommended settings), the decoding a served model does;
3. trains the DFlash drafter on it and, every other step, on windows of the training stream: blocks
   anchored there (the anchor token, then 15 mask tokens; the context is every position before the
   anchor), 16 blocks per sequence, the target's hidden states at
   the tapped layers as context, the target's own next-token distribution at each block position
   as the label (cross-entropy, positions weighted exp(-(j-1)/7));
4. writes the drafter's weights and has the project's drafter_config code write its config.json
   from the file's header (the pipeline operators run);
5. chooses the proof's prompts from the held-out stream: 16 lengths from 16 to 1500 tokens, up to 4
   prompts each among 48 candidates: those whose greedy continuation by the target (float32) is real
   text (at least 24 distinct tokens in 128, no period of 4 or less), the clearest top-1/top-2 gap
   first; and four prefixes for the sampled test.

Where the ``fla`` package (flash-linear-attention's Triton kernels) is importable, transformers
trains the Gated DeltaNet layers with it instead of its PyTorch reference path (build.json's
``gdn_kernel``); the proofs' own reference never uses it.

Deterministic from the seeds: fixed step counts per kind (``STEPS``; ``--target-steps`` and
``--drafter-steps`` change them), a fixed amount of on-policy text, and PyTorch's deterministic
algorithms (any op that has none is named in build.json's ``nondeterministic_ops``), so a rebuild
on the same GPU model gives the same files: build.json's ``sha256`` lists every file's digest to
compare with. ``--deadline-s`` only guards a GPU call against a slow machine: a phase it cuts is
recorded as ``stopped_early`` (and that build is not reproducible). Each part's wall time is in
build.json.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.trained import corpus, models
from ddtree.trained.realtext import degenerate

SEQ = 2048
BATCH = 16
GEN = 96
GEN_PREFIXES = (32, 64, 128, 256, 384, 512, 768, 1024, 1400)
GEN_SEQUENCES = 40  # continuations per prefix length, times 512 / the prefix length
PROMPT_LENGTHS = [round(16 * (1500 / 16) ** (i / 15)) for i in range(16)]  # 16 .. 1500
PROMPTS_PER_LENGTH = 4
CANDIDATES_PER_LENGTH = 48
PROOF_TOKENS = 128
SAMPLED_PREFIX_LENGTHS = (24, 64, 160, 400)
DRAFT_WINDOW = 1024  # training-stream windows the drafter also learns from
DRAFT_MIN_CONTEXT = 16  # their first anchor
SEED = 0
# (target, drafter) steps: both pairs build at once in about 7 minutes on one H100. Building beside the
# pure-attention pair with deterministic algorithms, the hybrid's target trains at about 51k tokens/s
# there: 400 steps overran the default deadline's share of the target (297 done), 300 fit it.
STEPS = {"hybrid": (300, 1200), "attention": (1300, 1150)}
# on-policy generation batches (of GEN_PREFIXES x greedy/sampled, in order): the hybrid's is slow
# on the PyTorch Gated DeltaNet path, so it writes fewer
ON_POLICY_BATCHES = {"hybrid": 6, "attention": 18}
CANDIDATE_ROUNDS = 4  # draws of CANDIDATES_PER_LENGTH per length until PROMPTS_PER_LENGTH are real text


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- prepare
def cmd_prepare(out: str) -> int:
    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    files = corpus.list_sources()
    train = [f for f in files if not f.held_out]
    held = [f for f in files if f.held_out]
    log(f"corpus: {len(files)} files ({len(held)} held out), digest {corpus.corpus_digest(files)[:16]}")
    t1 = time.time()
    tok_path = corpus.train_tokenizer(files, os.path.join(out, "tokenizer"))
    t2 = time.time()
    streams = {}
    for name, part, limit in (("train", train, 80 << 20), ("held_out", held, 8 << 20)):
        stream = corpus.token_stream(corpus.encode(tok_path, part, limit))
        np.asarray(stream, dtype=np.uint16).tofile(os.path.join(out, f"{name}.tokens"))
        streams[name] = len(stream)
    t3 = time.time()
    report = {
        "files": len(files),
        "held_out_files": len(held),
        "held_out_rule": f"sha256(path)[0] < {corpus.HELD_OUT_BELOW}",
        "corpus_sha256": corpus.corpus_digest(files),
        "package_dirs": corpus.package_dirs(),
        "tokenizer_sha256": _sha256(tok_path),
        "vocab_text": corpus.VOCAB_TEXT,
        "mask_token_id": corpus.MASK_TOKEN_ID,
        "tokens": streams,
        "seconds": {"list": round(t1 - t0, 1), "tokenizer": round(t2 - t1, 1), "encode": round(t3 - t2, 1)},
    }
    Path(out, "corpus.json").write_text(json.dumps(report, indent=1))
    log(json.dumps(report))
    return 0


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def file_digests(pair_dir: str) -> dict[str, str]:
    """Every file of a built pair but build.json (its timings differ run to run), by relative path."""
    root = Path(pair_dir)
    return {
        str(f.relative_to(root)): _sha256(str(f))
        for f in sorted(root.rglob("*"))
        if f.is_file() and f.name != "build.json"
    }


def load_stream(root: str, name: str, device) -> torch.Tensor:
    data = np.fromfile(os.path.join(root, f"{name}.tokens"), dtype=np.uint16).astype(np.int64)
    return torch.from_numpy(data).to(device)


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(length, device=stream.device)]


# --------------------------------------------------------------------------- target
def mean_loss(losses: list[torch.Tensor]) -> float | None:
    return round(float(torch.stack(losses).float().mean()), 4) if losses else None


class Plan:
    """A phase's fixed step count; the deadline stops a phase that runs slower than planned."""

    def __init__(self, steps: int, deadline: float):
        self.steps = steps
        self.deadline = deadline

    def stop(self, step: int) -> bool:
        return step >= self.steps or time.time() > self.deadline


def optimise(name: str, module: torch.nn.Module, opt, plan: Plan, peak_lr: float, warmup: int, batch_loss):
    """Run ``plan`` on ``module``: each step sets the cosine learning rate, takes ``batch_loss(step)`` and
    an optimiser step on it with gradients clipped to norm 1; a progress line every 100 steps. Returns
    (steps done, their losses)."""
    t0 = time.time()
    done, losses = 0, []
    for step in range(plan.steps):
        if plan.stop(step):
            break
        for group in opt.param_groups:
            group["lr"] = models.cosine_lr(step, plan.steps, peak_lr, warmup)
        loss = batch_loss(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        done = step + 1
        losses.append(loss.detach())
        if step % 100 == 0:
            log(f"{name} step {step}/{plan.steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    return done, losses


def train_target(kind: str, root: str, steps: int, deadline: float, dev) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(SEED)
    lm = models.causal_lm(kind).to(dev)
    train = load_stream(root, "train", dev)
    g = torch.Generator(device=dev).manual_seed(SEED + 1)
    decay = [p for n, p in lm.named_parameters() if p.dim() == 2 and "embed" not in n]
    rest = [p for n, p in lm.named_parameters() if not (p.dim() == 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=2e-3, betas=(0.9, 0.95)
    )

    def batch_loss(step: int) -> torch.Tensor:
        starts = torch.randint(0, len(train) - SEQ - 1, (BATCH,), device=dev, generator=g)
        seq = windows(train, starts, SEQ + 1)
        with torch.autocast("cuda" if dev.type == "cuda" else "cpu", dtype=torch.bfloat16):
            logits = lm(seq[:, :-1]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())

    t0 = time.time()
    lm.train()
    plan = Plan(steps, deadline)
    done, losses = optimise(f"{kind} target", lm, opt, plan, 2e-3, 100, batch_loss)
    lm.eval()
    seconds = time.time() - t0
    held = evaluate_target(lm, root, dev)
    report = {
        "params": models.count_params(lm),
        "steps": done,
        "steps_planned": plan.steps,
        "stopped_early": done < plan.steps,
        "batch": [BATCH, SEQ],
        "tokens_seen": done * BATCH * SEQ,
        "tokens_per_s": round(done * BATCH * SEQ / seconds),
        "train_loss_last100": mean_loss(losses[-100:]),
        **held,
        "seconds": round(seconds, 1),
    }
    return lm, report


@torch.no_grad()
def evaluate_target(lm, root: str, dev) -> dict:
    held = load_stream(root, "held_out", dev)
    n = 32
    starts = torch.linspace(0, len(held) - SEQ - 2, n, device=dev).long()
    total, top1, count = 0.0, 0.0, 0
    for i in range(0, n, 8):
        seq = windows(held, starts[i : i + 8], SEQ + 1)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = lm(seq[:, :-1]).logits.float()
        total += float(F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten(), reduction="sum"))
        top1 += float(logits.softmax(-1).amax(-1).sum())
        count += seq[:, 1:].numel()
    return {"held_out_loss": round(total / count, 4), "held_out_mean_top1_prob": round(top1 / count, 4)}


# --------------------------------------------------------------------------- on-policy text
@torch.no_grad()
def generate(lm, prefixes: torch.Tensor, new: int, temperature: float) -> torch.Tensor:
    """Continuations by the target itself, with a KV / recurrent-state cache (greedy at temperature 0;
    else temperature 0.7-style sampling with top-p 0.95 and top-k 20)."""
    out = lm(prefixes, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1].float()
    toks = []
    for _ in range(new):
        nxt = logits.argmax(-1) if temperature == 0 else sample(logits, temperature, 0.95, 20)
        toks.append(nxt)
        out = lm(nxt[:, None], past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
    return torch.cat([prefixes, torch.stack(toks, 1)], dim=1)


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    logits = logits / temperature
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    sorted_p, idx = probs.sort(-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > top_p
    sorted_p = sorted_p.masked_fill(drop, 0)
    choice = torch.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1)
    return idx.gather(-1, choice).squeeze(-1)


def on_policy(lm, root: str, dev, count: int, deadline: float) -> tuple[list[tuple[int, torch.Tensor]], bool]:
    """(prefix length, [n, prefix + GEN] token ids) for the first ``count`` generation batches, and
    whether the deadline cut them short (after at least one greedy and one sampled batch)."""
    train = load_stream(root, "train", dev)
    g = torch.Generator(device=dev).manual_seed(SEED + 2)
    batches: list[tuple[int, torch.Tensor]] = []
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        for i, p in enumerate(GEN_PREFIXES):
            for temperature in (0.0, 0.7):
                if len(batches) >= count:
                    return batches, False
                if time.time() > deadline and len(batches) >= 2:
                    return batches, True
                n = max(8, GEN_SEQUENCES * 512 // p)  # shorter prefixes: more sequences per batch
                starts = torch.randint(0, len(train) - p - 1, (n,), device=dev, generator=g)
                torch.manual_seed(SEED + 100 + i)
                batches.append((p, generate(lm, windows(train, starts, p), GEN, temperature)))
    return batches, False


# --------------------------------------------------------------------------- drafter
def train_drafter(kind: str, lm, data, root: str, steps: int, deadline: float, dev) -> tuple[models.Drafter, dict]:
    """Every other step a batch of the target's own continuations, else windows of the training
    stream: the labels are the target's distributions either way, and the stream costs no generation
    (the hybrid's generation is slow), so the drafter sees far more contexts in its time."""
    torch.manual_seed(SEED + 3)
    train = load_stream(root, "train", dev)
    ids = models.drafter_layer_ids(models.LAYERS, len(models.DRAFT_LAYER_TYPES))
    drafter = models.Drafter(models.DrafterShape(taps=len(ids))).to(dev)
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1.5e-3, betas=(0.9, 0.95), weight_decay=0.01)
    weights = models.loss_weights(dev)
    g = torch.Generator(device=dev).manual_seed(SEED + 4)
    anchors_per_seq = 16  # blocks per sequence share one target forward, the costly part

    def batch_loss(step: int) -> torch.Tensor:
        if step % 2:
            starts = torch.randint(0, len(train) - DRAFT_WINDOW - 1, (8192 // DRAFT_WINDOW,), device=dev, generator=g)
            p, seq = DRAFT_MIN_CONTEXT, windows(train, starts, DRAFT_WINDOW)
        else:
            p, seqs = data[int(torch.randint(0, len(data), (1,), generator=g, device=dev))]
            pick = torch.randint(0, len(seqs), (min(len(seqs), max(4, 8192 // (p + GEN))),), generator=g, device=dev)
            seq = seqs[pick]
        return drafter_loss(drafter, lm, embed, head, seq, p, anchors_per_seq, ids, weights, g)

    t0 = time.time()
    plan = Plan(steps, deadline)
    done, losses = optimise(f"{kind} drafter", drafter, opt, plan, 1.5e-3, 50, batch_loss)
    drafter.eval()
    return drafter, {
        "params": models.count_params(drafter),
        "target_layer_ids": ids,
        "steps": done,
        "steps_planned": plan.steps,
        "stopped_early": done < plan.steps,
        "train_loss_last100": mean_loss(losses[-100:]),
        "seconds": round(time.time() - t0, 1),
    }


def drafter_loss(drafter, lm, embed, head, seq, p, m, ids, weights, g):
    """Cross-entropy of the drafter's block predictions against the target's own distributions."""
    B, T = seq.shape
    with torch.no_grad(), torch.autocast(seq.device.type, dtype=torch.bfloat16):
        out = lm(seq, output_hidden_states=True)
        taps = models.tapped_states(out.hidden_states, ids).float()
        target_logp = out.logits.float().log_softmax(-1)
    # anchors in the continuation: a block's labels are the target's own choices after its anchor
    anchors = p + torch.randint(0, T - p - models.BLOCK + 1, (B, m), device=seq.device, generator=g)
    block = torch.full((B, m, models.BLOCK), models.MASK_TOKEN_ID, device=seq.device)
    block[:, :, 0] = seq.gather(1, anchors)
    with torch.autocast(seq.device.type, dtype=torch.bfloat16):
        h = drafter(taps, anchors, embed(block.flatten(1)).detach())
        logits = head(h.view(B, m, models.BLOCK, -1)[:, :, 1:]).float()
    # block position j predicts the token at anchor + j: the target's distribution at anchor + j - 1
    pos = anchors[:, :, None] + torch.arange(models.BLOCK - 1, device=seq.device)
    labels = target_logp.gather(1, pos.flatten(1)[:, :, None].expand(-1, -1, target_logp.shape[-1]))
    labels = labels.view(B, m, models.BLOCK - 1, -1).exp()
    ce = -(labels * logits.log_softmax(-1)).sum(-1)  # [B, m, 15]
    return (ce * weights).sum(-1).mean() / weights.sum()


@torch.no_grad()
def evaluate_drafter(drafter, lm, root: str, dev) -> dict:
    """Per block position, how often the drafter's top-1 is the target's greedy token, on the target's
    greedy continuations of held-out prefixes, and the chain acceptance that implies."""
    held = load_stream(root, "held_out", dev)
    ids = models.drafter_layer_ids(models.LAYERS, len(models.DRAFT_LAYER_TYPES))
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    hits = torch.zeros(models.BLOCK - 1, device=dev)
    chain, n = 0.0, 0
    for p in (64, 512):
        starts = torch.linspace(0, len(held) - p - 2, 32, device=dev).long()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            seq = generate(lm, windows(held, starts, p), GEN, 0.0)
            out = lm(seq, output_hidden_states=True)
        taps = models.tapped_states(out.hidden_states, ids).float()
        anchors = p + torch.arange(0, GEN - models.BLOCK + 1, 8, device=dev).expand(len(seq), -1)
        block = torch.full((*anchors.shape, models.BLOCK), models.MASK_TOKEN_ID, device=dev)
        block[:, :, 0] = seq.gather(1, anchors)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            h = drafter(taps, anchors, embed(block.flatten(1)))
            guess = head(h.view(*anchors.shape, models.BLOCK, -1)[:, :, 1:]).argmax(-1)
        truth = seq.gather(1, (anchors[:, :, None] + torch.arange(1, models.BLOCK, device=dev)).flatten(1))
        right = guess.flatten(1) == truth
        right = right.view(*anchors.shape, models.BLOCK - 1)
        hits += right.float().sum((0, 1))
        chain += float(right.int().cumprod(-1).sum(-1).float().sum())
        n += anchors.numel()
    return {
        "held_out_top1_by_position": [round(float(x), 4) for x in hits / n],
        "held_out_chain_acceptance_length": round(1 + chain / n, 3),
    }


def save_drafter(drafter: models.Drafter, out_dir: str, target_dir: str) -> dict:
    """The weights, then config.json from drafter_config's own code reading the file's header."""
    from safetensors.torch import save_file

    from ddtree.repo import module_util

    dflash_drafter, safetensors_header = module_util("dflash_drafter"), module_util("safetensors_header")

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    state = {k: v.to(torch.bfloat16).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, path, metadata={"format": "pt"})
    header = safetensors_header.inspect_path(path)
    tensors = {name: (t.dtype, t.shape) for name, t in header.tensors.items()}
    text, config, report = dflash_drafter.generate(
        tensors,
        target_dir,
        block_size=models.BLOCK,
        layer_types=list(drafter.s.layer_types),
        sliding_window=drafter.s.window,
    )
    Path(out_dir, "config.json").write_text(text)
    return {"config": config, "inferred": report}


# --------------------------------------------------------------------------- prompts
@torch.no_grad()
def greedy_with_gaps(lm, prompts: torch.Tensor, steps: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy continuations in float32 and the top-1 minus top-2 logit gap at every step."""
    out = lm(prompts, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1].float()
    toks, gaps = [], []
    for _ in range(steps):
        top = logits.topk(2, -1).values
        gaps.append(top[:, 0] - top[:, 1])
        nxt = logits.argmax(-1)
        toks.append(nxt)
        out = lm(nxt[:, None], past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
    return torch.stack(toks, 1).tolist(), torch.stack(gaps, 1).tolist()


def choose_prompts(lm, root: str, dev) -> dict:
    held = load_stream(root, "held_out", dev)
    g = torch.Generator(device=dev).manual_seed(SEED + 5)
    lm32 = lm.float()
    chosen, report = [], []
    for length in PROMPT_LENGTHS:
        cands, toks, gaps = [], [], []
        # real text only (identity on a loop proves nothing): draw again where too few are
        for _ in range(CANDIDATE_ROUNDS):
            starts = torch.randint(0, len(held) - length - 1, (CANDIDATES_PER_LENGTH,), device=dev, generator=g)
            drawn = windows(held, starts, length)
            t, gp = greedy_with_gaps(lm32, drawn, PROOF_TOKENS)
            cands += list(drawn)
            toks += t
            gaps += gp
            if sum(degenerate(x) is None for x in toks) >= PROMPTS_PER_LENGTH:
                break
        # the clearest greedy path first
        scored = sorted(((min(gaps[i]), i) for i in range(len(cands)) if degenerate(toks[i]) is None), reverse=True)
        keep = scored[:PROMPTS_PER_LENGTH]
        for gap, i in keep:
            chosen.append({"ids": cands[i].tolist(), "min_gap_fp32": round(gap, 4), "distinct": len(set(toks[i]))})
        report.append(
            {
                "length": length,
                "candidates": len(cands),
                "real_text_candidates": len(scored),
                "chosen_min_gaps": [round(g, 4) for g, _ in keep],
                "distinct_tokens": [len(set(toks[i])) for _, i in keep],
            }
        )
    starts = torch.linspace(0, len(held) - 1000, len(SAMPLED_PREFIX_LENGTHS), device=dev).long()
    sampled = [held[s : s + n].tolist() for s, n in zip(starts.tolist(), SAMPLED_PREFIX_LENGTHS, strict=True)]
    return {
        "prompts": [c["ids"] for c in chosen],
        "prompt_info": chosen,
        "by_length": report,
        "sampled_prefixes": sampled,
    }


# --------------------------------------------------------------------------- the pair
def deterministic() -> None:
    """PyTorch's deterministic algorithms (before CUDA starts: cuBLAS reads its workspace setting
    then); an op without one warns rather than stops the build, and the warning is recorded."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Attention's fused backwards stay nondeterministic under warn_only (cuDNN's always: the first
    # deterministic build named it); the math backend is matmuls and a softmax, deterministic as they are.
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)


def cmd_pair(kind: str, root: str, target_steps: int, drafter_steps: int, deadline_s: float) -> int:
    deterministic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = build_pair(kind, root, target_steps, drafter_steps, deadline_s)
    report["nondeterministic_ops"] = sorted({str(w.message)[:200] for w in caught if "determinis" in str(w.message)})
    report["sha256"] = file_digests(os.path.join(root, kind))
    Path(root, kind, "build.json").write_text(json.dumps(report, indent=1))
    log(json.dumps({k: report[k] for k in ("target", "seconds", "nondeterministic_ops")}))
    log(json.dumps({k: v for k, v in report["drafter"].items() if k not in ("config", "inferred")}))
    return 0


def build_pair(kind: str, root: str, target_steps: int, drafter_steps: int, deadline_s: float) -> dict:
    t_start = time.time()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out = os.path.join(root, kind)
    os.makedirs(out, exist_ok=True)
    seconds: dict[str, float] = {}
    t = time.time()
    lm, target_report = train_target(kind, root, target_steps, t_start + 0.45 * deadline_s, dev)
    models.set_mask_embedding(lm.get_input_embeddings().weight, SEED + 6)
    tdir = os.path.join(out, "target")
    models.save_target(kind, lm, tdir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        Path(tdir, name).write_bytes(Path(root, "tokenizer", name).read_bytes())
    seconds["target"] = round(time.time() - t, 1)
    lm = lm.to(torch.bfloat16).float().eval()  # the weights as vLLM loads them
    for p in lm.parameters():
        p.requires_grad_(False)
    t = time.time()
    data, text_cut = on_policy(lm, root, dev, ON_POLICY_BATCHES[kind], t_start + 0.52 * deadline_s)
    seconds["on_policy_text"] = round(time.time() - t, 1)
    t = time.time()
    drafter, drafter_report = train_drafter(kind, lm, data, root, drafter_steps, t_start + 0.82 * deadline_s, dev)
    drafter_report.update(evaluate_drafter(drafter, lm, root, dev))
    drafter_report.update(save_drafter(drafter, os.path.join(out, "drafter"), tdir))
    seconds["drafter"] = round(time.time() - t, 1)
    t = time.time()
    prompts = choose_prompts(lm, root, dev)
    Path(out, "prompts.json").write_text(json.dumps(prompts))
    seconds["prompts"] = round(time.time() - t, 1)
    seconds["total"] = round(time.time() - t_start, 1)
    report = {
        "kind": kind,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "gdn_kernel": "fla" if importlib.util.find_spec("fla") else "torch",
        "corpus": json.loads(Path(root, "corpus.json").read_text()),
        "target": target_report,
        "on_policy_text": {
            "batches": len(data),
            "sequences": sum(len(s) for _, s in data),
            "generated_tokens_each": GEN,
            "stopped_early": text_cut,
        },
        "drafter": drafter_report,
        "prompts": prompts["by_length"],
        "seconds": seconds,
    }
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare")
    s.add_argument("dir")
    s = sub.add_parser("pair")
    s.add_argument("kind", choices=["hybrid", "attention"])
    s.add_argument("dir")
    s.add_argument("--target-steps", type=int, help="default: STEPS for the kind")
    s.add_argument("--drafter-steps", type=int, help="default: STEPS for the kind")
    s.add_argument("--deadline-s", type=float, default=480, help="a guard: a phase it cuts is not reproducible")
    a = ap.parse_args()
    if a.cmd == "prepare":
        return cmd_prepare(a.dir)
    target_steps, drafter_steps = STEPS[a.kind]
    return cmd_pair(a.kind, a.dir, a.target_steps or target_steps, a.drafter_steps or drafter_steps, a.deadline_s)


if __name__ == "__main__":
    raise SystemExit(main())
