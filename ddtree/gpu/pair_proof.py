#!/usr/bin/env python3
"""GPU proof for the ddtree change set on vLLM 0.20.1 (needs an NVIDIA GPU; see docs/ddtree_patch.md).

Run from the repository root: ``python3 -m ddtree.gpu.pair_proof SUB-COMMAND ...``.

Sub-commands:

  apply SITE_PACKAGES     apply the change set (ddtree/vllm-<release>/) to the vLLM installed in
                          SITE_PACKAGES with module_utils/vllm_changeset (the vllm_patch module's
                          engine); re-apply must change nothing. Prints a JSON report.
  make-models DIR         tiny random models (bf16): target/ (pure-attention Qwen3, 8 layers, vocab 64,
                          with a word-level tokenizer for `vllm serve`) and drafter/ (DFlash, 2 layers,
                          taps target layers [1, 5]; config.json from module_utils/dflash_drafter), and
                          prompts.json: per prompt length, the candidate whose greedy path keeps the
                          clearest top-1/top-2 gap (see greedy_margins: identity needs no near-ties).
  make-hybrid DIR         the real pair's architectures, tiny and random (bf16): target/ a
                          Qwen3_5ForConditionalGeneration (Gated DeltaNet x3 + gated full attention,
                          twice; M-RoPE; a minimal vision tower vLLM skips with language_model_only),
                          drafter/ (DFlash, 3 causal sliding-window layers of window HY_WINDOW + 1 full
                          layer, as Qwen3.6-27B-DFlash), drafter_full/ (the same tensors, every layer
                          full attention) and prompts.json, chosen as for make-models.
  gen --result FILE ...   one vllm.LLM instance: batch-1 runs (one prompt at a time), then the
                          batch-4 run; writes token ids, spec-decode counters and timings.
  driver MODELS OUT       every run of the proof (identity in bf16 and fp16, sampled, CUDA-graph speed),
                          then OUT/summary.json (lossless checks, mean acceptance lengths, tokens/s).
  summarise OUT           rebuild OUT/summary.json from the runs' NAME.json and NAME.log a driver left
                          in OUT (when the driver was stopped, or only the runs' files were kept).

The tree build + walk benchmark is ddtree/bench/tree_bench.py; the service_swap unit's GPU
check is tests/gpu/serve_check.py.

How the drafter agrees "often but not always" (a weakened forced-acceptance construction): every
token embedding shares one component, so the random target emits a context-dependent mix of a few
tokens. The mask token's embedding (the drafter shares the target's embeddings and lm_head) is set
to a large multiple of the target's average output direction, so the drafter drafts the target's
most frequent tokens, best first, at every depth: chains are accepted part-way, and trees gain when
the target picks a token the chain did not draft.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from ddtree import HOME, REPO, bases, repo
from ddtree.bench.step_cost import hybrid_engine_args

# The CUDA-graph sizes service_swap renders for DDTree: the proof runs what the role deploys.
ddtree_cudagraph_sizes = repo.repo_file("plugins/filter/ddtree_method.py").ddtree_cudagraph_sizes
# The vLLM base this proof runs on (ddtree/vllm-<release>/): its change set and its refusals.
PROOF_BASE = "0.20.1"

VOCAB = 64
HIDDEN = 256
LAYERS_TARGET = 8
LAYERS_DRAFT = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
INTER = 512
MAX_POS = 4096
MASK_TOKEN_ID = 63
TARGET_LAYER_IDS = [1, 5]  # DFlash rule for 8 target layers, 2 draft layers: round(1 + i * 4 / 1)
SEED = 0
DRAFTER_SHARPNESS = 60.0
DEPTH = 7  # DFlash block 8: num_speculative_tokens for the chain and the DDTree depth


GEN_TOKENS = 64  # greedy tokens per prompt in the identity runs
CANDIDATES = 64  # prompts drawn per length; the proof keeps the one with the clearest greedy path


def candidate_prompts() -> list[list[int]]:
    """Random prompts of lengths 5, 12, 23 and 40 (the first of each length is the old fixed set)."""
    import random

    r = random.Random(1234)
    first = [[r.randrange(2, MASK_TOKEN_ID) for _ in range(n)] for n in (5, 12, 23, 40)]
    more = [[r.randrange(2, MASK_TOKEN_ID) for _ in range(n)] for _ in range(CANDIDATES - 1) for n in (5, 12, 23, 40)]
    return first + more


def prompts(models: str | None = None) -> list[list[int]]:
    """The proof's prompts: those make-models chose (prompts.json beside target/), else the first four."""
    if models and os.path.exists(os.path.join(models, "prompts.json")):
        with open(os.path.join(models, "prompts.json")) as f:
            return json.load(f)["prompts"]
    return candidate_prompts()[:4]


def greedy_margins(model, batch: list[list[int]], steps: int):
    """Greedy continuation of equal-length prompts, and the top-1 minus top-2 logit gap at every step.

    Token-for-token identity between two kernels is only well defined where the target's choice is
    clear: at a near-tie (a gap of a few thousandths in a random bf16 model) two correct attention
    kernels may round to different tokens. The proof therefore runs on prompts whose whole greedy
    path keeps a clear gap, and records the smallest gap of each.
    """
    import torch

    dev = next(model.parameters()).device
    ids = torch.tensor(batch, device=dev)
    toks, gaps = [], []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for _ in range(steps):
            logits = out.logits[:, -1].float()
            top = logits.topk(2, dim=-1).values
            gaps.append(top[:, 0] - top[:, 1])
            nxt = logits.argmax(-1, keepdim=True)
            toks.append(nxt)
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(toks, 1).tolist(), torch.stack(gaps, 1).tolist()


def choose_prompts(model) -> tuple[list[list[int]], list[dict]]:
    """Per prompt length, the candidate whose greedy path has the largest smallest gap."""
    cands = candidate_prompts()
    chosen, report = [], []
    for n in sorted({len(p) for p in cands}):
        group = [p for p in cands if len(p) == n]
        _tokens, gaps = greedy_margins(model, group, GEN_TOKENS)
        best = max(range(len(group)), key=lambda i: min(gaps[i]))
        first = min(gaps[0])
        chosen.append(group[best])
        report.append(
            {
                "length": n,
                "chosen_min_gap": round(min(gaps[best]), 5),
                "old_fixed_prompt_min_gap": round(first, 5),
                "candidates_min_gap_quartiles": [round(sorted(min(g) for g in gaps)[q], 5) for q in (15, 31, 47)],
            }
        )
    return chosen, report


# ---------------------------------------------------------------------------
def cmd_apply(site: str) -> int:
    cs = repo.module_util("vllm_changeset")

    root = str(HOME)
    install_version = None
    meta = sorted(Path(site).glob("vllm-*.dist-info/METADATA"))
    for m in meta:
        for line in m.read_text().splitlines():
            if line.startswith("Version:"):
                install_version = line.split(":", 1)[1].strip()
    changeset = cs.load_changeset(root, install_version or PROOF_BASE, "ddtree")
    plan = cs.plan(changeset, site, cs.PRESENT)
    changed = cs.execute(plan)
    again = cs.plan(changeset, site, cs.PRESENT)
    report = {
        "vllm_version": install_version,
        "manifest_sha256": changeset.manifest_sha256,
        "found_before": plan.file_states(),
        "changed": changed,
        "reapply_changes": again.changed_paths,
    }
    print(json.dumps(report, indent=1))
    return 0 if not again.changed else 1


# ---------------------------------------------------------------------------
def _tiny_qwen3_config(num_layers: int):
    """The tiny Qwen3 of the pure-attention target and of both drafters' bodies."""
    from transformers import Qwen3Config

    return Qwen3Config(
        num_hidden_layers=num_layers,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        attention_bias=False,
    )


def cmd_make_models(root: str) -> int:
    import torch
    from transformers import Qwen3ForCausalLM

    os.makedirs(root, exist_ok=True)
    torch.manual_seed(SEED)
    tcfg = _tiny_qwen3_config(LAYERS_TARGET)
    tcfg.architectures = ["Qwen3ForCausalLM"]
    target = Qwen3ForCausalLM(tcfg).float()
    g = torch.Generator().manual_seed(SEED + 7)
    e = torch.randn(HIDDEN, generator=g)
    e = e / e.norm()
    with torch.no_grad():
        # One component shared by every token's embedding: the random target then emits a
        # context-dependent mix of a few tokens instead of repeating one token per prompt.
        target.model.embed_tokens.weight.add_(e)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # Computed in float32 on the bf16-rounded weights: those are the weights vLLM loads.
    target = target.to(torch.bfloat16).float().to(dev).eval()
    chosen, choice_report = choose_prompts(target)
    steer = _steer_drafter(target, target.model, chosen, dev)
    target = target.to(torch.bfloat16).float()  # the mask embedding as vLLM will load it
    final_gaps = [min(greedy_margins(target, [p], GEN_TOKENS)[1][0]) for p in chosen]
    target = target.to("cpu").to(torch.bfloat16)
    target.save_pretrained(os.path.join(root, "target"), safe_serialization=True)
    write_tokenizer(os.path.join(root, "target"))
    with open(os.path.join(root, "prompts.json"), "w") as f:
        json.dump({"prompts": chosen, "min_gap_fp32": [round(x, 5) for x in final_gaps]}, f)
    sd = _drafter_tensors(LAYERS_DRAFT, SEED + 1, len(TARGET_LAYER_IDS))
    config = _write_drafter(root, "drafter", sd, os.path.join(root, "target"), target_layer_ids=TARGET_LAYER_IDS)
    info = {
        "prompt_choice": choice_report,
        "chosen_prompts_min_gap_fp32": [round(x, 5) for x in final_gaps],
        **steer,
        "drafter_config_source": "module_utils/dflash_drafter.generate",
        "drafter_config": config,
    }
    with open(os.path.join(root, "models.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info, indent=1)[:3000])
    return 0


# The real pair's architectures, tiny: Qwen3.6's layer pattern (three Gated DeltaNet layers, then
# one gated full-attention layer), M-RoPE, and a DFlash drafter whose sliding layers come first, as in
# Qwen3.6-27B-DFlash. A window of 16 is far shorter than the prompts plus 64 generated tokens.
HY_LAYERS_TARGET = 8
HY_DRAFT_TYPES = ["sliding_attention"] * 3 + ["full_attention"]
HY_WINDOW = 16
HY_TARGET_LAYER_IDS = [1, 2, 4, 5]  # the DFlash rule for 8 target layers and 4 draft layers
HY_OUT_OF_VOCAB = 1000  # vision token ids: none can appear in a prompt, so every prompt is text


def _hybrid_target_config():
    """The trained pair's hybrid architecture (ddtree/trained/models.py) at this proof's tiny sizes."""
    from ddtree.trained.models import hybrid_checkpoint_config, hybrid_text_config

    text = hybrid_text_config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=HY_LAYERS_TARGET,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        eos_token_id=1,
    )
    return hybrid_checkpoint_config(text, out_of_vocab=HY_OUT_OF_VOCAB)


def _steer_drafter(target, language_model, chosen: list[list[int]], dev: str) -> dict:
    """Point the mask token's embedding at the target's average output direction (see the top).

    ``language_model`` maps token ids to the final-norm hidden states; ``target`` has ``lm_head``.
    """
    import torch

    finals, emitted = [], []
    with torch.no_grad():
        for p in chosen:
            ids = torch.tensor([p], device=dev)
            for _ in range(48):
                u = language_model(ids).last_hidden_state[0, -1]
                finals.append(u)
                nxt = target.lm_head(u).argmax()
                emitted.append(int(nxt))
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        mean_dir = torch.stack(finals).mean(0)
        mean_dir = mean_dir / mean_dir.norm()
        language_model.embed_tokens.weight[MASK_TOKEN_ID] = 100.0 * mean_dir
        drafter_like = (16.0 * DRAFTER_SHARPNESS * target.lm_head.weight @ mean_dir).float()
        top_v, top_i = drafter_like.topk(5)
    return {
        "target_greedy_token_counts_hf_fp32": {t: emitted.count(t) for t in sorted(set(emitted))},
        "drafter_like_top5": {"tokens": top_i.tolist(), "logits": [round(float(v), 3) for v in top_v]},
    }


def _write_drafter(root: str, name: str, sd: dict, target_dir: str, **layers) -> dict:
    """The drafter's weights and the config.json that module_utils/dflash_drafter generates for them.

    No hand-written config: the proof is that vLLM runs the config the project generates.
    """
    dflash_drafter = repo.module_util("dflash_drafter")
    from safetensors.torch import save_file

    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    tensors = {k: ("BF16", list(v.shape)) for k, v in sd.items()}
    _text, config, _report = dflash_drafter.generate(
        tensors, target_dir, block_size=DEPTH + 1, mask_token_id=MASK_TOKEN_ID, **layers
    )
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return config


def _drafter_tensors(num_layers: int, seed: int, num_taps: int) -> dict:
    import torch
    from transformers import Qwen3Model

    torch.manual_seed(seed)
    body = Qwen3Model(_tiny_qwen3_config(num_layers)).to(torch.bfloat16)
    sd = {
        k: v.contiguous()
        for k, v in body.state_dict().items()
        if not k.startswith("embed_tokens") and "rotary_emb" not in k
    }
    gd = torch.Generator().manual_seed(seed + 1)
    sd["fc.weight"] = (torch.randn(HIDDEN, HIDDEN * num_taps, generator=gd) * 0.02).to(torch.bfloat16)
    sd["hidden_norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    # Sharpen the drafter: its final norm scales its logits, so it is confident about the
    # target's most frequent token and gives the runner-up a real share (a tree then holds
    # both), instead of a nearly flat distribution over the vocabulary.
    sd["norm.weight"] = torch.full((HIDDEN,), DRAFTER_SHARPNESS, dtype=torch.bfloat16)
    return sd


def cmd_make_hybrid(root: str) -> int:
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    os.makedirs(root, exist_ok=True)
    torch.manual_seed(SEED)
    target = Qwen3_5ForConditionalGeneration(_hybrid_target_config()).float()
    lm = target.model.language_model
    g = torch.Generator().manual_seed(SEED + 7)
    e = torch.randn(HIDDEN, generator=g)
    with torch.no_grad():
        lm.embed_tokens.weight.add_(e / e.norm())
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = target.to(torch.bfloat16).float().to(dev).eval()
    lm = target.model.language_model
    chosen, choice_report = choose_prompts(target)
    steer = _steer_drafter(target, lm, chosen, dev)
    target = target.to(torch.bfloat16).float()
    final_gaps = [min(greedy_margins(target, [p], GEN_TOKENS)[1][0]) for p in chosen]
    tdir = os.path.join(root, "target")
    target.to("cpu").to(torch.bfloat16).save_pretrained(tdir, safe_serialization=True)
    with open(os.path.join(root, "prompts.json"), "w") as f:
        json.dump({"prompts": chosen, "min_gap_fp32": [round(x, 5) for x in final_gaps]}, f)
    sd = _drafter_tensors(len(HY_DRAFT_TYPES), SEED + 1, len(HY_TARGET_LAYER_IDS))
    sliding = _write_drafter(
        root,
        "drafter",
        sd,
        tdir,
        target_layer_ids=HY_TARGET_LAYER_IDS,
        layer_types=HY_DRAFT_TYPES,
        sliding_window=HY_WINDOW,
    )
    full = _write_drafter(root, "drafter_full", sd, tdir, target_layer_ids=HY_TARGET_LAYER_IDS)
    info = {
        "prompt_choice": choice_report,
        "chosen_prompts_min_gap_fp32": [round(x, 5) for x in final_gaps],
        **steer,
        "drafter_config_source": "module_utils/dflash_drafter.generate",
        "drafter_config": sliding,
        "drafter_full_config": full,
    }
    with open(os.path.join(root, "models.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info, indent=1)[:3000])
    return 0


def write_tokenizer(target: str) -> None:
    """A word-level tokenizer over the tiny vocabulary, so `vllm serve` can take text prompts.

    Ids 0, 1, 2 are <s>, </s>, <unk>; id i > 2 is the word ``w<i>``. Any other word maps to <unk>.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(target, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<s>",
        "model_max_length": MAX_POS,
    }
    with open(os.path.join(target, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


# ---------------------------------------------------------------------------
def _metrics(llm) -> dict:
    out: dict = {}
    try:
        for m in llm.get_metrics():
            if "spec_decode" in m.name or m.name.startswith("vllm:generation_tokens"):
                v = getattr(m, "value", None)
                if v is None:
                    v = getattr(m, "values", None)
                out[m.name] = v
    except Exception as exc:
        out["error"] = repr(exc)
    return out


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, int | float) and isinstance(b, int | float):
            out[k] = v - b
        elif isinstance(v, list) and isinstance(b, list) and len(v) == len(b):
            out[k] = [x - y for x, y in zip(v, b, strict=False)]
        else:
            out[k] = v
    return out


def _mal(m: dict) -> float | None:
    drafts = m.get("vllm:spec_decode_num_drafts")
    acc = m.get("vllm:spec_decode_num_accepted_tokens")
    if not drafts:
        return None
    return round(1 + acc / drafts, 4)


# Sampling parameters DDTree refuses when a request arrives (docs/ddtree_patch.md), as the base's
# descriptor lists them; the target alone and the chain serve them all.
REFUSAL_PROBES = bases.load(PROOF_BASE)["refuses"]["probes"]


def _top2(output) -> list[list[list[float]]]:
    """Per generated position, the two best [token, logit] pairs (logprobs_mode raw_logits), the token
    the target chose first (on equal logits too)."""
    return [
        sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda x: (-x[1], x[0] != chosen))[:2]
        for step, chosen in zip(output.logprobs, output.token_ids, strict=True)
    ]


def cmd_gen(a: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    max_num_seqs, max_num_batched_tokens = 8, 2048
    kw = dict(
        model=a.model,
        skip_tokenizer_init=True,
        enforce_eager=not a.graphs,
        gpu_memory_utilization=0.25,
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        dtype={"bf16": "bfloat16", "fp16": "float16"}[a.dtype],
        seed=SEED,
        disable_log_stats=False,
        kv_cache_memory_bytes=2 << 30,
    )
    if a.graphs and a.method == "ddtree":
        # The graph sizes service_swap renders for DDTree: one per uniform verification batch.
        verified = a.budget or DEPTH
        kw["compilation_config"] = {
            "cudagraph_capture_sizes": ddtree_cudagraph_sizes(max_num_seqs, verified, max_num_batched_tokens)
        }
    elif a.graphs:
        kw["compilation_config"] = {"max_cudagraph_capture_size": 256}
    if a.hybrid:
        # Qwen3.5/3.6, and no prefix caching with spec decode on hybrids.
        kw.update(hybrid_engine_args(), enable_prefix_caching=False)
    if a.method:
        drafter = a.drafter or os.path.join(os.path.dirname(a.model.rstrip("/")), a.drafter_name)
        sc = {"method": a.method, "model": drafter, "num_speculative_tokens": DEPTH}
        if a.budget:
            sc["ddtree_budget"] = a.budget
        kw["speculative_config"] = sc
    if a.backend:
        kw["attention_backend"] = a.backend
    if a.sync_scheduling:
        kw["async_scheduling"] = False
    if a.top2:
        # Logprobs as the model's own logits (float32 of their dtype's values), before any processing.
        kw["logprobs_mode"] = "raw_logits"
    t0 = time.time()
    llm = LLM(**kw)
    init_s = time.time() - t0
    res: dict = {"kwargs": {k: v for k, v in kw.items()}, "init_s": round(init_s, 1)}
    if a.temperature > 0:
        sp = SamplingParams(
            temperature=a.temperature,
            top_p=0.95,
            max_tokens=a.max_tokens,
            ignore_eos=True,
            detokenize=False,
            seed=None,
        )
    else:
        top2 = 2 if a.top2 else None
        sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True, detokenize=False, logprobs=top2)
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(os.path.dirname(a.model.rstrip("/")))]
    # warm-up (not counted)
    llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False))
    m0 = _metrics(llm)
    t = time.time()
    o1 = [llm.generate([p], sp)[0].outputs[0] for p in ps]
    b1_s = time.time() - t
    m1 = _metrics(llm)
    t = time.time()
    o4 = [o.outputs[0] for o in llm.generate(ps, sp)]
    b4_s = time.time() - t
    b1, b4 = [list(o.token_ids) for o in o1], [list(o.token_ids) for o in o4]
    if a.top2:
        res["top2_batch1"], res["top2_batch4"] = [_top2(o) for o in o1], [_top2(o) for o in o4]
    m2 = _metrics(llm)
    d1, d4 = _delta(m1, m0), _delta(m2, m1)
    # allowed_token_ids (every second token the greedy runs produced): DDTree must choose as the
    # target alone does under the same mask. Then the parameters DDTree refuses on arrival.
    allowed = sorted({t for seq in b1 for t in seq})[::2]
    limited = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False, allowed_token_ids=allowed)
    res["allowed_batch4"] = [list(o.outputs[0].token_ids) for o in llm.generate(ps, limited)]
    refused = {}
    for name, extra in REFUSAL_PROBES.items():
        try:
            llm.generate(ps[:1], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False, **extra))
            refused[name] = "served"
        except ValueError as e:
            refused[name] = str(e)
    res["refused"] = refused
    n1 = sum(len(x) for x in b1)
    n4 = sum(len(x) for x in b4)
    res.update(
        {
            "batch1": b1,
            "batch4": b4,
            "batch1_s": round(b1_s, 3),
            "batch4_s": round(b4_s, 3),
            "batch1_tok_s": round(n1 / b1_s, 1),
            "batch4_tok_s": round(n4 / b4_s, 1),
            "metrics_batch1": d1,
            "metrics_batch4": d4,
            "mean_acceptance_length_batch1": _mal(d1),
            "mean_acceptance_length_batch4": _mal(d4),
        }
    )
    with open(a.result, "w") as f:
        json.dump(res, f, default=str)
    print(
        "RESULT",
        json.dumps({k: v for k, v in res.items() if "batch" not in k or "tok" in k or "mean" in k}, default=str),
    )
    return 0


# ---------------------------------------------------------------------------
IDENTITY = {
    "target_fa": ["--top2"],
    "target_tree_attn": ["--backend", "TREE_ATTN", "--top2"],
    "chain_k7": ["--method", "dflash"],
    "ddtree_b7": ["--method", "ddtree", "--budget", "7"],
    "ddtree_b16": ["--method", "ddtree", "--budget", "16"],
    "ddtree_b48": ["--method", "ddtree", "--budget", "48"],
}
RUNS = {
    # name: (args, wave). The identity runs in bf16 and in fp16 (3 more mantissa bits: kernel
    # rounding differences are 8x smaller), then sampled runs, then the speed runs one at a time.
    **{
        f"{n}_{dt}": ([*a, "--max-tokens", str(GEN_TOKENS), "--dtype", dt], 0)
        for dt in ("bf16", "fp16")
        for n, a in IDENTITY.items()
    },
    "ddtree_sampled_b16": (["--method", "ddtree", "--budget", "16", "--max-tokens", "64", "--temperature", "0.8"], 0),
    "chain_sampled": (["--method", "dflash", "--max-tokens", "64", "--temperature", "0.8"], 0),
    "perf_target": (["--max-tokens", "256", "--graphs"], 1),
    "perf_chain_k7": (["--method", "dflash", "--max-tokens", "256", "--graphs"], 2),
    "perf_ddtree_b16": (["--method", "ddtree", "--budget", "16", "--max-tokens", "256", "--graphs"], 3),
}

# The real pair's architectures (make-hybrid). "base" runs on any release with DFlash: the target
# alone, and the chain with the sliding-window drafter as trained and with its all-full twin.
# "ddtree" adds DDTree at budgets of the depth, twice and four times the depth.
HY_IDENTITY = {
    "target": ["--top2"],
    "chain_sliding": ["--method", "dflash"],
    "chain_full": ["--method", "dflash", "--drafter-name", "drafter_full"],
}
HY_DDTREE = {f"ddtree_b{b}": ["--method", "ddtree", "--budget", str(b)] for b in (DEPTH, 2 * DEPTH, 4 * DEPTH)}


def hybrid_runs(with_ddtree: bool) -> dict[str, tuple[list[str], int]]:
    """Identity runs eager in bf16 and fp16 (wave 0), then under CUDA graphs in bf16 (wave 1)."""
    kinds = {**HY_IDENTITY, **(HY_DDTREE if with_ddtree else {})}
    runs: dict[str, tuple[list[str], int]] = {}
    for n, a in kinds.items():
        for dt in ("bf16", "fp16"):
            runs[f"hy_{n}_{dt}"] = ([*a, "--hybrid", "--max-tokens", str(GEN_TOKENS), "--dtype", dt], 0)
        runs[f"hy_{n}_graphs_bf16"] = ([*a, "--hybrid", "--max-tokens", str(GEN_TOKENS), "--graphs"], 1)
    if with_ddtree:
        # DDTree schedules asynchronously by default; synchronous scheduling (--no-async-scheduling)
        # takes the other path through the runner, so it is proven too.
        sync_b = HY_DDTREE[f"ddtree_b{2 * DEPTH}"] + ["--sync-scheduling"]
        runs[f"hy_ddtree_b{2 * DEPTH}_sync_bf16"] = ([*sync_b, "--hybrid", "--max-tokens", str(GEN_TOKENS)], 0)
        runs[f"hy_ddtree_b{2 * DEPTH}_sync_graphs_bf16"] = (
            [*sync_b, "--hybrid", "--max-tokens", str(GEN_TOKENS), "--graphs"],
            1,
        )
        runs["hy_ddtree_sampled_b14"] = (
            [*HY_DDTREE[f"ddtree_b{2 * DEPTH}"], "--hybrid", "--max-tokens", "64", "--temperature", "0.8"],
            1,
        )
    return runs


def run_set(name: str) -> dict[str, tuple[list[str], int]]:
    if name == "attention":
        return RUNS
    if name in ("hybrid-base", "hybrid"):
        return hybrid_runs(with_ddtree=name == "hybrid")
    raise SystemExit(f"unknown run set {name!r}: attention, hybrid-base or hybrid")


def refusals_as_expected(ddtree: bool, refused: dict[str, str]) -> dict:
    """DDTree refuses every probe with its reason; the target alone and the chain serve them all."""
    ok = all(("cannot honour" in v) if ddtree else (v == "served") for v in refused.values()) and set(refused) == set(
        REFUSAL_PROBES
    )
    return {"as_expected": ok, **refused}


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}


def dtype_step(x: float, dtype: str) -> float:
    """The spacing of the dtype's values at |x|: the finest difference two logits of that size can have."""
    _, exp = math.frexp(abs(x))  # |x| = m * 2**exp with 0.5 <= m < 1
    return math.ldexp(1.0, exp - 1 - MANTISSA_BITS[dtype])


def _gap(top: list[list[float]], first: int, second: int) -> float | None:
    """logit(first) - logit(second) when both are among the step's recorded best tokens (two, or three
    where the target recorded three: a three-way tie), else None."""
    logits = {int(t): v for t, v in top}
    return logits[first] - logits[second] if first in logits and second in logits and first != second else None


def kernel_noise(a: dict, b: dict) -> float:
    """How far two correct kernels (the target alone on two attention backends) move the gap between
    the target's two best logits: the largest absolute difference, over every position both computed
    from the same tokens (up to and including the first where their choices part). 0.0 where they
    recorded no logits."""
    noise = 0.0
    for key in ("batch1", "batch4"):
        for i, (sa, sb) in enumerate(zip(a.get(f"top2_{key}", []), b.get(f"top2_{key}", []), strict=False)):
            parted = _first_diff(a[key][i], b[key][i])
            for x, y in list(zip(sa, sb, strict=False))[: None if parted is None else parted + 1]:
                first, second = int(x[0][0]), int(x[1][0])
                gb = _gap(y, first, second)
                if gb is not None:
                    noise = max(noise, abs(x[0][1] - x[1][1] - gb))
    return noise


def divergence(top2: list[list[float]], target_token: int, run_token: int, dtype: str, noise: float) -> dict:
    """A run's token where the target alone chose another: a near-tie only if the two tokens are among
    the target's recorded best (two, or three) and their logits are no further apart than rounding moves them (`noise`, the
    target's own two kernels' largest disagreement, and at least one step of the dtype there)."""
    gap = _gap(top2, target_token, run_token)
    if gap is None:
        return {
            "target_top2": top2,
            "run_token": run_token,
            "near_tie": False,
            "why": "not among the target's recorded best",
        }
    step = dtype_step(max(abs(v) for _, v in top2), dtype)
    return {
        "target_top2": top2,
        "run_token": run_token,
        "gap": gap,
        "gap_in_dtype_steps": round(gap / step, 3),
        "near_tie": gap <= max(step, noise),
    }


def compare(ref: dict, run: dict, noise: float = 0.0) -> dict:
    """Token ids of a run against the target alone's; where the target recorded its two best logits
    (--top2), each prompt's first divergence says whether it fell on a near-tie (see divergence).
    After a departure the two continue from different text: the rest of that prompt is not compared."""
    out = {}
    dtype = str(ref.get("kwargs", {}).get("dtype", ""))
    for key in ("batch1", "batch4", "allowed_batch4"):
        if key == "allowed_batch4" and not (key in ref and key in run):
            continue
        diffs = [_first_diff(x, y) for x, y in zip(ref[key], run[key], strict=False)]
        out[key] = {"identical": all(d is None for d in diffs), "first_divergence": diffs}
        top2 = ref.get(f"top2_{key}")
        if top2 is None or dtype not in MANTISSA_BITS or out[key]["identical"]:
            continue
        found: list[dict | None] = []
        for i, d in enumerate(diffs):
            if d is None:
                found.append(None)
            elif d < min(len(top2[i]), len(run[key][i])):
                found.append(divergence(top2[i][d], ref[key][i][d], run[key][i][d], dtype, noise))
            else:
                found.append({"near_tie": False, "why": "one of the two stopped early"})
        out[key]["divergences"] = found
        # Lossless where the target's choice is clear: every divergence a near-tie.
        out[key]["only_near_ties"] = all(v["near_tie"] for v in found if v is not None)
    return out


def _hy_ref(name: str) -> str:
    """hy_chain_sliding_graphs_bf16 -> hy_target_graphs_bf16: the target alone in the same mode."""
    mode = "graphs_bf16" if name.endswith("_graphs_bf16") else name.rsplit("_", 1)[1]
    return f"hy_target_{mode}"


def cmd_driver(
    models: str, out: str, only: list[str] | None, budget_s: float, one_wave: bool = False, runs_set: str = "attention"
) -> int:
    os.makedirs(out, exist_ok=True)
    t_start = time.time()
    chosen = run_set(runs_set)
    runs = {k: (v[0], 0 if one_wave else v[1]) for k, v in chosen.items() if not only or k in only}
    results: dict = {}
    waves = sorted({w for _, w in runs.values()})
    for wave in waves:
        jobs = []
        for name, (args, w) in runs.items():
            if w != wave:
                continue
            if time.time() - t_start > budget_s:
                results[name] = {"error": "skipped: time budget"}
                continue
            res = os.path.join(out, f"{name}.json")
            log = open(os.path.join(out, f"{name}.log"), "w")  # noqa: SIM115 - closed after the wave
            cmd = [sys.executable, "-m", "ddtree.gpu.pair_proof", "gen", "--result", res, "--model", f"{models}/target"]
            p = subprocess.Popen(cmd + args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            jobs.append((name, p, res, log))
        for name, p, res, log in jobs:
            try:
                p.wait(timeout=max(30, budget_s - (time.time() - t_start)))
            except subprocess.TimeoutExpired:
                p.kill()
            log.close()
            results[name] = read_run(Path(res), Path(log.name), p.returncode)
    return write_summary(out, summarise(results, round(time.time() - t_start, 1)))


def read_run(res: Path, log: Path, returncode: int | None) -> dict:
    """One run's result as the summary takes it: its JSON with the log's notable lines, or the log's tail."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if not res.exists():
        return {"error": f"rc={returncode}", "log_tail": text[-4000:]}
    try:
        result = json.loads(res.read_text())
    except ValueError as e:
        return {"error": f"{res} is not a whole JSON result ({e}): run it again", "log_tail": text[-4000:]}
    keys = ("DDTree", "Error", "refused", "backend")
    result["log_notes"] = [ln[-300:] for ln in text.splitlines() if any(w in ln for w in keys)][:25]
    return result


def summarise(results: dict, wall_s: float | None) -> dict:
    """The proof's verdicts from every run's result (read_run): lossless checks, acceptance, tokens/s, refusals."""
    summary: dict = {"runs": {}, "lossless": {}, "acceptance": {}, "tokens_per_s": {}, "refusals": {}}
    for name, r in results.items():
        summary["runs"][name] = {k: v for k, v in r.items() if k not in ("batch1", "batch4", "allowed_batch4")}
        if "refused" in r:
            summary["refusals"][name] = refusals_as_expected("ddtree" in name, r["refused"])
    for dt in ("bf16", "fp16"):
        fa, ta = results.get(f"target_fa_{dt}", {}), results.get(f"target_tree_attn_{dt}", {})
        noise = 0.0
        if "top2_batch4" in fa and "top2_batch4" in ta:
            noise = kernel_noise(fa, ta)
            summary.setdefault("kernel_noise", {})[dt] = noise
        for name in IDENTITY:
            r = results.get(f"{name}_{dt}", {})
            if name != "target_fa" and "batch4" in r and "batch4" in fa:
                summary["lossless"][f"{name}_{dt}_vs_target_fa_{dt}"] = compare(fa, r, noise)
            if name.startswith("ddtree") and "batch4" in r and "batch4" in ta:
                summary["lossless"][f"{name}_{dt}_vs_target_tree_attn_{dt}"] = compare(ta, r, noise)
    for name, r in results.items():
        # Hybrid runs: each against the target alone of the same dtype and graph mode.
        if not name.startswith("hy_") or name.startswith("hy_target") or "sampled" in name:
            continue
        ref = results.get(_hy_ref(name), {})
        if "batch4" in r and "batch4" in ref:
            summary["lossless"][f"{name}_vs_{_hy_ref(name)}"] = compare(ref, r)
    for name, r in results.items():
        if "mean_acceptance_length_batch4" in r:
            summary["acceptance"][name] = {
                "batch1": r["mean_acceptance_length_batch1"],
                "batch4": r["mean_acceptance_length_batch4"],
            }
        if "batch1_tok_s" in r:
            summary["tokens_per_s"][name] = {"batch1": r["batch1_tok_s"], "batch4": r["batch4_tok_s"]}
    base = summary["tokens_per_s"].get("perf_target")
    if base:
        summary["speedup_vs_target_cuda_graphs"] = {
            name: {k: round(v[k] / base[k], 3) for k in ("batch1", "batch4")}
            for name, v in summary["tokens_per_s"].items()
            if name.startswith("perf_")
        }
    summary["token_ids"] = {n: {"batch4": r.get("batch4")} for n, r in results.items() if "batch4" in r}
    summary["wall_s"] = wall_s
    return summary


def write_summary(out: str, summary: dict) -> int:
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in summary.items() if k != "token_ids" and k != "runs"}, indent=1))
    for name, r in summary["runs"].items():
        if "error" in r:
            print("ERROR", name, r.get("error"), (r.get("log_tail") or "")[-1500:])
    return 0


def cmd_summarise(out: str) -> int:
    """Rebuild OUT/summary.json from the runs' files a driver left there (one NAME.json + NAME.log each)."""
    runs = sorted(f.stem for f in Path(out).glob("*.log"))  # every run writes its log from the start
    if not runs:
        print(f"{out} holds no run's NAME.log: give the driver's OUT folder", file=sys.stderr)
        return 2
    return write_summary(
        out, summarise({n: read_run(Path(out, f"{n}.json"), Path(out, f"{n}.log"), None) for n in runs}, None)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("apply")
    s.add_argument("site")
    s = sub.add_parser("make-models")
    s.add_argument("dir")
    s = sub.add_parser("make-hybrid")
    s.add_argument("dir")
    s = sub.add_parser("gen")
    s.add_argument("--result", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--drafter", help="the drafter's directory (default: DRAFTER_NAME beside the target)")
    s.add_argument("--drafter-name", default="drafter")
    s.add_argument("--method")
    s.add_argument("--budget", type=int)
    s.add_argument("--backend")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--graphs", action="store_true")
    s.add_argument("--sync-scheduling", action="store_true", help="schedule synchronously (default: async)")
    s.add_argument("--hybrid", action="store_true", help="the target is a Qwen3.5/3.6 hybrid")
    s.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    s.add_argument("--top2", action="store_true", help="the target alone: record its two best logits at every step")
    s = sub.add_parser("driver")
    s.add_argument("models")
    s.add_argument("out")
    s.add_argument("--only", nargs="*")
    s.add_argument("--budget-s", type=float, default=480)
    s.add_argument("--one-wave", action="store_true", help="run the selected runs all at once")
    s.add_argument("--set", dest="runs_set", default="attention", help="attention, hybrid-base or hybrid")
    s = sub.add_parser("summarise")
    s.add_argument("out")
    a = ap.parse_args()
    try:
        if a.cmd == "apply":
            return cmd_apply(a.site)
        if a.cmd == "make-models":
            return cmd_make_models(a.dir)
        if a.cmd == "make-hybrid":
            return cmd_make_hybrid(a.dir)
        if a.cmd == "gen":
            if a.top2 and (a.method or a.temperature > 0):
                raise SystemExit("--top2 records the target alone's greedy logits: drop --method and --temperature")
            return cmd_gen(a)
        if a.cmd == "summarise":
            return cmd_summarise(a.out)
        return cmd_driver(a.models, a.out, a.only, a.budget_s, a.one_wave, a.runs_set)
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
