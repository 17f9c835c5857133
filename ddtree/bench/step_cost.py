#!/usr/bin/env python3
"""ms per verification step at real model shapes: the target alone, the DFlash chain and DDTree budgets.

Random ("dummy") weights at the real shapes give real step costs: vLLM initialises them on the GPU
from config.json alone, and as random weights accept nothing, every speculative step yields one
token, so the decode time per step is what is compared. Each case is one vLLM process (one model
per process) measuring every (batch, context) pair: after a warm-up that also decodes, one pass of
``--tokens`` tokens whose decode time is the engine's own timestamps, from the step that gave every
request its first token to the one that gave the last, divided by the steps the spec-decode
counters report. A batch's prompts are prefilled in one step (max_num_batched_tokens holds them
all), so no decode step shares its time with another request's prefill. CUDA graphs stay on
(enforce_eager hides the per-step overhead).

Shapes: ``8b`` (Qwen3-8B + Qwen3-8B-DFlash-b16) and ``27b`` (Qwen3.6-27B, the Gated DeltaNet
hybrid, + Qwen3.6-27B-DFlash with its sliding-window layers). The drafters' config.json come from
module_utils/dflash_drafter (what the drafter_config role writes), the 27B target's from
tests/fakes/target_model.py (the real layout).

    python3 -m ddtree.bench.step_cost plan --shapes 8b,27b              # cases and the time they need
    python3 -m ddtree.bench.step_cost run --shapes 8b --out /tmp/steps   # needs vLLM 0.20.1 + the change set
    python3 -m ddtree.bench.step_cost table /tmp/steps                   # the table, ratios to the chain

A 27B case starts in about 4.5 minutes with cold caches (compilation and warm-up), an 8B case in
about two minutes, so one 10-minute call holds three 8B cases or one 27B case: ``plan`` splits them
into calls. A repeat of the same case on one machine reads vLLM's compilation cache; another method
of the same shape compiles again (at 27B about 110 s of a 240 s engine start), and only the first
case on a machine autotunes Triton's kernels (``case_env``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree import REPO, repo

# The CUDA-graph sizes service_swap renders for DDTree: the benchmark measures what the role deploys.
ddtree_cudagraph_sizes = repo.repo_file("plugins/filter/ddtree_method.py").ddtree_cudagraph_sizes

DEPTH = 15  # block size 16
# name -> DDTree budget (None: the target alone, 0: the DFlash chain). chain_sync and ddtree16_sync
# schedule synchronously (both default to async scheduling): they show what scheduling costs.
# target_tree is the target alone on TREE_ATTN, the backend DDTree verifies with.
METHODS = {
    "target": None,
    "target_tree": None,
    "chain": 0,
    "chain_sync": 0,
    "ddtree16": 16,
    "ddtree32": 32,
    "ddtree64": 64,
    "ddtree16_sync": 16,
}
# The engine settings a method adds to its budget's.
ENGINE_ARGS = {
    "target_tree": {"attention_backend": "TREE_ATTN"},
    "chain_sync": {"async_scheduling": False},
    "ddtree16_sync": {"async_scheduling": False},
}
BATCHES = (1, 8)
CONTEXTS = (512, 8192)
# Start-up with compilation on a machine with cold caches, measured on an H200: 8B 97 s chain, 141 s
# DDTree; 27B DDTree 265 s (compilation 126 s, warm-up 97 s). A repeat start on the same machine reads
# vLLM's and Triton's caches under ~/.cache and takes about 40 s.
START_S = {"8b": 120, "27b": 270}
RUN_S = 55  # the four (batch, context) pairs of one case, measured on an H200 (50 s at 8B, 55 s at 27B)
CALL_S = 560  # what one 10-minute call leaves for cases


@dataclass(frozen=True)
class Shape:
    name: str
    mask_token_id: int
    hybrid: bool


SHAPES = {"8b": Shape("Qwen3-8B", 151669, False), "27b": Shape("Qwen3.6-27B", 248070, True)}


def qwen3_8b_config() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def hybrid_engine_args() -> dict[str, Any]:
    """What a Qwen3.5/3.6 target needs from vLLM here: the language model only (no vision tower),
    and the Gated DeltaNet prefill on the Triton kernel (the default imports flashinfer)."""
    return {"language_model_only": True, "additional_config": {"gdn_prefill_backend": "triton"}}


def shape_engine_args(shape: str) -> dict[str, Any]:
    """What a shape's target needs from vLLM (hybrid_engine_args for Qwen3.6-27B)."""
    return hybrid_engine_args() if SHAPES[shape].hybrid else {}


def target_config(shape: str) -> dict[str, Any]:
    if shape == "8b":
        return qwen3_8b_config()
    target_model = repo.repo_file("tests/fakes/target_model.py")

    return target_model.config()


def drafter_tensors(published) -> dict[str, tuple[str, list[int]]]:
    """The tensor names and shapes of a published DFlash drafter (its safetensors header)."""
    h, hd, i = published.hidden_size, published.head_dim, published.intermediate_size
    q, kv = published.num_attention_heads * hd, published.num_key_value_heads * hd
    out: dict[str, tuple[str, list[int]]] = {
        "fc.weight": ("BF16", [h, published.num_tapped_layers * h]),
        "hidden_norm.weight": ("BF16", [h]),
        "norm.weight": ("BF16", [h]),
    }
    per_layer = {
        "input_layernorm.weight": [h],
        "post_attention_layernorm.weight": [h],
        "self_attn.q_proj.weight": [q, h],
        "self_attn.k_proj.weight": [kv, h],
        "self_attn.v_proj.weight": [kv, h],
        "self_attn.o_proj.weight": [h, q],
        "self_attn.q_norm.weight": [hd],
        "self_attn.k_norm.weight": [hd],
        "mlp.gate_proj.weight": [i, h],
        "mlp.up_proj.weight": [i, h],
        "mlp.down_proj.weight": [h, i],
    }
    for n in range(published.num_hidden_layers):
        for name, dims in per_layer.items():
            out[f"layers.{n}.{name}"] = ("BF16", dims)
    return out


def write_models(shape: str, root: Path) -> tuple[Path, Path]:
    """config.json of the target and of its drafter, under root/<shape>/."""
    dflash_drafter = repo.module_util("dflash_drafter")

    target = root / shape / "target"
    drafter = root / shape / "drafter"
    target.mkdir(parents=True, exist_ok=True)
    drafter.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(target_config(shape), indent=1))
    name = {"8b": "Qwen3-8B-DFlash-b16", "27b": "Qwen3.6-27B-DFlash"}[shape]
    published = next(p for p in dflash_drafter.PUBLISHED if p.name == name)
    sliding = "sliding_attention" in published.layer_types
    text, _config, _report = dflash_drafter.generate(
        drafter_tensors(published),
        str(target),
        block_size=DEPTH + 1,
        mask_token_id=SHAPES[shape].mask_token_id,
        layer_types=list(published.layer_types) if sliding else None,
        sliding_window=published.sliding_window,
    )
    (drafter / "config.json").write_text(text)
    return target, drafter


# ---------------------------------------------------------------------------
# What each method's figure is compared with: a ratio means something only between cases of one
# call (the same machine), so every call that measures a method measures its baseline too.
BASELINE = {
    "target_tree": "target",
    "chain_sync": "chain",
    "ddtree16": "chain",
    "ddtree32": "chain",
    "ddtree64": "chain",
    "ddtree16_sync": "chain",
}


def plan(shapes: list[str], methods: list[str]) -> list[list[tuple[str, str]]]:
    """The (shape, method) cases packed into calls of CALL_S seconds, in order, each call opening
    with the baseline of the methods it holds (when that baseline is asked for), so each ratio
    compares cases of one machine. A method always shares its call with its baseline, even where
    the two take longer than CALL_S (27B, cold): ``call_seconds`` says so."""
    calls: list[list[tuple[str, str]]] = []
    for shape in shapes:
        fit = CALL_S // (START_S[shape] + RUN_S)
        groups: dict[str | None, list[str]] = {}  # baseline (None: none asked for) -> its methods
        for method in methods:
            base = BASELINE.get(method)
            groups.setdefault(base if base in methods else None, []).append(method)
        for base, members in groups.items():
            head = [base] if base else []
            rest = [m for m in members if m not in groups]  # a baseline with methods opens their calls
            room = max(1, fit - len(head))
            calls.extend([(shape, m) for m in head + rest[i : i + room]] for i in range(0, len(rest), room))
    return calls


def call_seconds(call: list[tuple[str, str]], pairs: int = 4) -> int:
    """A call's estimated seconds: each case's cold start and its run of ``pairs`` (batch, context) pairs."""
    return sum(START_S[shape] + -(-RUN_S * pairs // 4) for shape, _method in call)


def case_timeout_s(shape: str) -> int:
    """How long one case may take before it is killed: its cold start-up and its run, with room."""
    return START_S[shape] + 2 * RUN_S


def case_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of a case's process: Triton keeps its autotuning results on disk, for the
    cases after the first on a machine. (Each 27B case still spent 75-104 s in vLLM's first
    profiling and warm-up run in one run of four, so ``plan`` counts every case as a cold start.)"""
    return {"TRITON_CACHE_AUTOTUNING": "1", **base}


def decode_ms_per_step(first_token_ts: list[float], last_token_ts: list[float], steps: float) -> float:
    """ms per decode step of a batch: from the step that gave every request its first token to the last."""
    if not first_token_ts or len(first_token_ts) != len(last_token_ts) or steps <= 0:
        raise ValueError("each request needs its first and last token time, and steps must be positive")
    span = max(last_token_ts) - max(first_token_ts)
    if span <= 0:
        raise ValueError(f"no decode time between the first and the last token ({span:.6f} s)")
    return round(1000 * span / steps, 3)


def batched_tokens(pairs: list[tuple[int, int]]) -> int:
    """max_num_batched_tokens for a case: the largest batch's prompts prefilled in one step (so no
    decode step shares its time with a prefill), and never below the longest context, which keeps
    DDTree's graph sizes those of eight requests. Nothing larger: vLLM's profile run prefills this
    many tokens and autotunes the Gated DeltaNet kernels at that size, about 110 s of a cold 27B
    start-up at 65,536 tokens, which a case of batch-1 pairs does not need."""
    return max(max(CONTEXTS), *(batch * context for batch, context in pairs))


def compilation_config(budget: int | None, tokens: int) -> dict[str, Any]:
    """DDTree runs with the CUDA graphs service_swap renders for it, one for every uniform
    verification batch of up to eight requests with ``tokens`` batched tokens
    (plugins/filter/ddtree_method.py: 8 requests at budget 64 are 520 tokens, past vLLM's default
    cap of 512); the target alone and the chain keep vLLM's default, as they are served."""
    if not budget:
        return {}
    return {"cudagraph_capture_sizes": ddtree_cudagraph_sizes(max(BATCHES), budget, tokens)}


def model_len(tokens: int) -> int:
    """max_model_len for a case: the longest prompt, the tokens generated and room for the largest
    DDTree step, so that no measured step runs near the end of the context. vLLM 0.20.1 runs the
    drafter only while the request's optimistic length (under async scheduling it still counts the
    last step's drafts) plus the budget fits, and the scheduler shortens a step that would pass the
    end: with only 64 tokens of room, DDTree 64 at 8192 tokens drafted on 2 of 128 steps and ran the
    second half as shortened steps without their full CUDA graph (about 2x the chain's step, none
    of it a tree's cost)."""
    largest = max(b for b in METHODS.values() if b) + 1
    return max(CONTEXTS) + tokens + 4 * largest


def load_results(folder: Path) -> list[dict[str, Any]]:
    """The rows of every case file in folder; other JSON there (a proof summary, logs) is not a case."""
    cases = [folder / f"{s}_{m}.json" for s in SHAPES for m in METHODS]
    return [r for f in cases if f.is_file() for r in json.loads(f.read_text())]


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each result row with its ratio to the chain of the same shape, batch, context and run (machines
    of one kind differ by up to a third, so rows of two runs are never divided); none for a row
    with a problem, or against one."""

    def key(r: dict[str, Any]) -> tuple:
        return r["shape"], r["batch"], r["context"], r.get("run", "")

    chain = {key(r): r for r in results if r["method"] == "chain"}
    out = []
    for r in results:
        base = chain.get(key(r))
        ok = base is not None and base.get("ms_per_step") and r.get("ms_per_step")
        ok = ok and not r.get("problem") and not base.get("problem")
        row = dict(r)
        row["vs_chain"] = round(r["ms_per_step"] / base["ms_per_step"], 3) if ok else None
        out.append(row)
    return out


def table(results: list[dict[str, Any]]) -> str:
    """The rows with their ratio to the chain; a row with a problem is marked, the problems listed below."""
    order = list(METHODS)
    rows = sorted(
        ratios(results),
        key=lambda r: (r["shape"], r["context"], r["batch"], order.index(r["method"]), r.get("run", "")),
    )
    lines = ["| shape | context | batch | method | ms/step | x chain |", "| --- | ---: | ---: | --- | ---: | ---: |"]
    notes = []
    for r in rows:
        ms = "-" if r.get("ms_per_step") is None else f"{r['ms_per_step']:.2f}"
        if r.get("problem"):
            notes.append(
                f"{len(notes) + 1}. {r['shape']} {r['method']} batch {r['batch']} at {r['context']}: {r['problem']}"
            )
            ms += f" ({len(notes)})"
        vs = "-" if r["vs_chain"] is None else f"{r['vs_chain']:.3f}"
        lines.append(f"| {r['shape']} | {r['context']} | {r['batch']} | {r['method']} | {ms} | {vs} |")
    runs = sorted({r.get("run", "") for r in rows})
    if len(runs) > 1:
        notes.append(f"{len(runs)} runs ({', '.join(x or 'unnamed' for x in runs)}): ratios only within one run.")
    return "\n".join(lines + (["", *notes] if notes else []))


# ---------------------------------------------------------------------------
def _spec_counters(llm) -> tuple[float, float]:
    """vLLM's spec-decode counters so far: (drafts, accepted tokens), summed over its engines."""
    found = {"vllm:spec_decode_num_drafts": 0.0, "vllm:spec_decode_num_accepted_tokens": 0.0}
    for m in llm.get_metrics():
        if m.name in found:
            found[m.name] += float(getattr(m, "value", 0) or 0)
    return found["vllm:spec_decode_num_drafts"], found["vllm:spec_decode_num_accepted_tokens"]


def decode_steps(tokens: int, batch: int, drafts: float, accepted: float, speculative: bool) -> tuple[float, str]:
    """(decode steps of a pass, problem): every step yields one token per request plus what it
    accepted, so a pass of ``tokens`` decoded tokens took ``tokens - accepted / batch`` steps.
    A speculative pass should have drafted on every one of them: where vLLM stopped drafting (too
    little room before max_model_len) the steps are not what the method costs, and the problem
    says so (such a row once passed for a step cost: 0 drafts then counted as ``tokens`` steps)."""
    if not speculative:
        return float(tokens), ""
    steps = tokens - accepted / batch
    drafted = drafts / batch
    if steps <= 0 or drafted < 0.95 * steps:
        return steps, f"drafted on {drafted:.0f} of {steps:.0f} steps per request: not this method's step cost"
    return steps, ""


PROFILE_TOKENS = 24  # decode steps of the profiled pass (context 512)


def parse_pairs(text: str | None) -> list[tuple[int, int]]:
    """``"8x512,1x8192"`` -> [(8, 512), (1, 8192)] (batch x context); None or "" -> every pair."""
    if not text:
        return [(b, c) for c in CONTEXTS for b in BATCHES]
    pairs = []
    for item in text.split(","):
        batch, sep, context = item.strip().partition("x")
        if not sep or not batch.isdigit() or not context.isdigit():
            raise ValueError(f"pair {item!r} is not BATCHxCONTEXT (e.g. 8x512)")
        if int(batch) not in BATCHES or int(context) not in CONTEXTS:
            raise ValueError(f"pair {item!r}: batch must be one of {BATCHES}, context one of {CONTEXTS}")
        pairs.append((int(batch), int(context)))
    return pairs


def run_case(
    shape: str,
    method: str,
    root: Path,
    tokens: int,
    profile: Path | None = None,
    pairs: list[tuple[int, int]] | None = None,
    profile_batch: int = 1,
    run: str = "",
) -> list[dict[str, Any]]:
    """One vLLM process: each (batch, context) pair of one (shape, method) (default every pair); with
    ``profile``, then a torch-profiled decode at context 512 and ``profile_batch`` requests,
    summarised into ``profile`` (step_profile.py). Rows carry ``run``, the `run` invocation that
    measured them (its machine and start), which ``ratios`` pairs on."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    target, drafter = write_models(shape, root)
    pairs = pairs or parse_pairs(None)
    tokens_per_step = batched_tokens(pairs)
    kw: dict[str, Any] = dict(
        model=str(target),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=model_len(tokens),
        max_num_seqs=max(BATCHES),
        max_num_batched_tokens=tokens_per_step,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.9,
        disable_log_stats=False,
    )
    kw.update(shape_engine_args(shape))
    budget = METHODS[method]
    kw["compilation_config"] = compilation_config(budget, tokens_per_step)
    kw.update(ENGINE_ARGS.get(method, {}))
    if profile is not None:
        # The scopes step_profile.py splits a step by; read when vLLM starts.
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
        kw["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": str(profile / f"{shape}_{method}"),
            "torch_profiler_with_stack": False,
            "torch_profiler_dump_cuda_time_total": False,
        }
    if budget is not None:
        spec: dict[str, Any] = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": DEPTH}
        if budget:
            spec.update(method="ddtree", ddtree_budget=budget)
        kw["speculative_config"] = spec
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    vocab = target_config(shape).get("vocab_size") or target_config(shape)["text_config"]["vocab_size"]
    rng = random.Random(0)
    out = []
    for batch, context in pairs:
        prompts = [
            TokensPrompt(prompt_token_ids=[rng.randrange(vocab // 2) for _ in range(context)]) for _ in range(batch)
        ]
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
        many = SamplingParams(temperature=0, max_tokens=1 + tokens, ignore_eos=True, detokenize=False)
        llm.generate(prompts, warm)  # this shape's prefill and decode, once
        d0, a0 = _spec_counters(llm)
        outputs = llm.generate(prompts, many)
        d1, a1 = _spec_counters(llm)
        steps, problem = decode_steps(tokens, batch, d1 - d0, a1 - a0, budget is not None)
        stats = [o.metrics for o in outputs]
        out.append(
            {
                "shape": shape,
                "method": method,
                "batch": batch,
                "context": context,
                "steps": steps,
                "ms_per_step": decode_ms_per_step(
                    [m.first_token_ts for m in stats], [m.last_token_ts for m in stats], steps
                ),
                "start_s": round(start_s, 1),
                "batched_tokens": tokens_per_step,
                "run": run,
                **({"problem": problem} if problem else {}),
            }
        )
    if profile is not None:
        from ddtree.bench import step_profile

        prompt = [
            TokensPrompt(prompt_token_ids=[rng.randrange(vocab // 2) for _ in range(min(CONTEXTS))])
            for _ in range(profile_batch)
        ]
        params = SamplingParams(temperature=0, max_tokens=PROFILE_TOKENS, ignore_eos=True, detokenize=False)
        llm.generate(prompt, params)
        try:  # the measured rows above stand whatever the profiler does
            llm.start_profile()
            llm.generate(prompt, params)
            llm.stop_profile()
            trace = step_profile.newest_trace(profile / f"{shape}_{method}")
            summary = step_profile.summarize(step_profile.load_trace(trace))
        except (OSError, RuntimeError, ValueError) as e:
            summary = {"error": f"{type(e).__name__}: {e}"}
        summary["batch"] = profile_batch
        (profile / f"{shape}_{method}_profile.json").write_text(json.dumps(summary, indent=1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("plan", "run"):
        s = sub.add_parser(name)
        s.add_argument("--shapes", default="8b,27b")
        s.add_argument("--methods", default=",".join(METHODS))
    s = sub.choices["run"]
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--tokens", type=int, default=128)
    s.add_argument("--case-timeout", type=int, help="seconds one case may take, start-up included (default: by shape)")
    s.add_argument("--profile", action="store_true", help="also profile each case (scopes on for every step)")
    s = sub.add_parser("case")
    s.add_argument("shape")
    s.add_argument("method")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--tokens", type=int, default=128)
    s.add_argument("--profile", type=Path, help="folder for the profiled pass's trace and summary")
    s.add_argument("--run", default="", help="the run that measures this case (its rows carry it)")
    for name in ("plan", "run", "case"):
        sub.choices[name].add_argument("--pairs", help="BATCHxCONTEXT pairs to measure, e.g. 8x512 (default: all)")
    for name in ("run", "case"):
        sub.choices[name].add_argument("--profile-batch", type=int, default=1, help="requests in the profiled pass")
    s = sub.add_parser("table")
    s.add_argument("dir", type=Path)
    a = ap.parse_args()
    if a.cmd in ("plan", "run"):
        shapes, methods = a.shapes.split(","), a.methods.split(",")
        if a.cmd in ("plan", "run"):
            try:
                parse_pairs(a.pairs)
            except ValueError as e:
                raise SystemExit(str(e)) from None
        unknown = sorted(set(shapes) - set(SHAPES)) + sorted(set(methods) - set(METHODS))
        if unknown:
            raise SystemExit(
                f"unknown shapes or methods: {', '.join(unknown)} (shapes {list(SHAPES)}, methods {list(METHODS)})"
            )
    if a.cmd == "plan":
        for n, call in enumerate(plan(shapes, methods), 1):
            seconds = call_seconds(call, len(parse_pairs(a.pairs)))
            over = (
                f", more than the {CALL_S} s a call leaves: its second case may not finish" if seconds > CALL_S else ""
            )
            print(f"call {n} (about {seconds} s{over}): " + ", ".join(f"{s}/{m}" for s, m in call))
        return 0
    if a.cmd == "case":
        a.out.mkdir(parents=True, exist_ok=True)
        rows = run_case(
            a.shape, a.method, a.out / "models", a.tokens, a.profile, parse_pairs(a.pairs), a.profile_batch, a.run
        )
        (a.out / f"{a.shape}_{a.method}.json").write_text(json.dumps(rows, indent=1))
        return 0
    if a.cmd == "run":
        a.out.mkdir(parents=True, exist_ok=True)
        run = f"{socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
        for shape in shapes:
            for method in methods:
                log = a.out / f"{shape}_{method}.log"
                cmd = [
                    sys.executable,
                    "-m",
                    "ddtree.bench.step_cost",
                    "case",
                    shape,
                    method,
                    "--out",
                    str(a.out),
                    "--tokens",
                    str(a.tokens),
                ]
                cmd += ["--run", run]
                if a.profile:
                    cmd += ["--profile", str(a.out / "profile"), "--profile-batch", str(a.profile_batch)]
                if a.pairs:
                    cmd += ["--pairs", a.pairs]
                # A case that hangs (a budget too large for the step) must not eat the call's other cases.
                timeout = a.case_timeout or case_timeout_s(shape)
                with log.open("w") as f:
                    try:
                        rc = subprocess.run(
                            cmd, stdout=f, stderr=subprocess.STDOUT, env=case_env(os.environ), timeout=timeout, cwd=REPO
                        ).returncode
                    except subprocess.TimeoutExpired:
                        rc = f"timed out after {timeout} s"
                print(f"{shape}/{method}: rc={rc}", flush=True)
        a.dir = a.out
    results = load_results(a.dir)
    print(table(results))
    (a.dir / "summary.md").write_text(table(results) + "\n")
    (a.dir / "summary.json").write_text(json.dumps(ratios(results), indent=1) + "\n")
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
