"""GPU proof of DDTree on the trained pairs (vLLM 0.20.1 with the change set; see ddtree/trained/build.py).

    python3 -m ddtree.trained.proof driver PAIR OUT [--runs NAME ...]  # engine runs, then OUT/summary.json
    python3 -m ddtree.trained.proof reference PAIR OUT                 # the plain-PyTorch DDTree (no vLLM)
    python3 -m ddtree.trained.proof summarise PAIR OUT                 # rebuild OUT/summary.json (no GPU)

Every engine run is one ``vllm.LLM`` in its own process (``gen``) for one method (the target alone,
the DFlash chain of 15, DDTree at budgets 15 / 32 / 64), dtype, graph mode and scheduling. Its phases:

- ``greedy``: the pair's 64 held-out prompts (16 to 1500 tokens), 128 tokens each, at batch 1 (one
  prompt at a time), batch 4 (the first 16 prompts in fours), batch 8 (all, in eights that start
  together) and mixed (all, eight in flight, the next joining as one finishes, so prompts are
  prefilled beside other requests' verification, as a server batches), read step by step: every engine step's new tokens per request are that step's accepted nodes plus its
  bonus token. The target alone also records its two best logits at every token (near-ties).
- ``sampled``: the same prompts at temperature 0.7, top-p 0.95, top-k 20, batch 1 and 8: acceptance.
- ``distribution``: ``SAMPLES`` samples of the next 4 tokens from each of the pair's 4 fixed prefixes,
  at temperature 0.7 (top-p 0.95, top-k 20) and at 1.0, for the two-sample test against the target.

``--broken`` replaces the tree walk by one that takes the drafter's first child at every node where
one exists (the drafter's token without the target's sample): its ``distribution`` must fail the
test the real walk passes, which shows the test can tell.

The summary judges: every greedy output of every run identical to the target alone's in the same
dtype, graph mode and batch, or departing first at a near-tie (``pair_proof.divergence``); every
output real text (``realtext.degenerate``); acceptance per method (mean length and per depth);
the engine's accepted count at every batch-1 greedy step equal to the plain-PyTorch DDTree's on the
same prompt (up to where the engine's output departs from the reference's float32 target);
the sampled tokens' distribution per position (chi-square homogeneity, stratified over prefixes).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path

from ddtree.trained.realtext import degenerate
from ddtree.trained.stats import acceptance, homogeneity, kept_tokens, near_tie_prefix

REPO = Path(__file__).resolve().parents[2]
GEN_TOKENS = 128
DEPTH = 15
SAMPLES = 2000
DRAFT_LOGIT_SCALE = 8.0  # the trained drafters' largest logits are about 6-7: the rounding step there
SAMPLED_TOKENS = 4
QWEN_SAMPLING = {"temperature": 0.7, "top_p": 0.95, "top_k": 20}
PURE_SAMPLING = {"temperature": 1.0}
SAMPLING = {"qwen": QWEN_SAMPLING, "pure": {"top_k": 0, "top_p": 1.0} | PURE_SAMPLING}  # as kept_tokens takes them


def _pair_proof():
    """The near-tie rule and engine helpers of the random-pair proof (one rule for both proofs)."""
    return importlib.import_module("ddtree.gpu.pair_proof")


def run_config(name: str) -> dict:
    """A run's settings from its name: METHOD_DTYPE[_graphs][_sync][_treeattn][_dist][_broken][_nan].

    METHOD is target, chain or ddtreeN (budget N); treeattn puts the target alone on TREE_ATTN (the
    backend DDTree verifies with: the two backends' disagreement bounds a near-tie); dist and broken
    runs sample the distribution test only (broken: with the walk broken on purpose); nan poisons the
    first request's drafter logits with NaN every third drafter pass (a drafter overflowing in fp16,
    a corrupt drafter file): the engine must keep serving, every output still the target's."""
    parts = name.split("_")
    cfg = {
        "method": None,
        "budget": None,
        "dtype": "bf16",
        "graphs": False,
        "sync": False,
        "broken": False,
        "treeattn": False,
        "dist": False,
        "nan": False,
    }
    if parts[0] == "chain":
        cfg["method"] = "dflash"
    elif parts[0].startswith("ddtree"):
        cfg["method"], cfg["budget"] = "ddtree", int(parts[0][len("ddtree") :])
    elif parts[0] != "target":
        raise ValueError(f"run {name!r}: starts with target, chain or ddtreeN")
    for p in parts[1:]:
        if p in ("bf16", "fp16"):
            cfg["dtype"] = p
        elif p in ("graphs", "sync", "broken", "treeattn", "dist", "nan"):
            cfg[p] = True
        else:
            raise ValueError(f"run {name!r}: unknown part {p!r}")
    return cfg


# --------------------------------------------------------------------------- one engine run
def engine_kwargs(pair: str, cfg: dict) -> dict:
    pp = _pair_proof()
    kind = json.loads(Path(pair, "build.json").read_text())["kind"]
    seqs, batched = (8, 2048) if cfg["graphs"] else (64, 8192)
    kw = dict(
        model=os.path.join(pair, "target"),
        skip_tokenizer_init=True,
        enforce_eager=not cfg["graphs"],
        gpu_memory_utilization=0.15,  # a start-up check of free memory only: many runs share the GPU
        max_model_len=2560,
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        dtype={"bf16": "bfloat16", "fp16": "float16"}[cfg["dtype"]],
        seed=0,
        disable_log_stats=False,
        kv_cache_memory_bytes=2 << 30,
    )
    if kind == "hybrid":
        kw.update(pp.hybrid_engine_args(), enable_prefix_caching=False)
    if cfg["graphs"]:
        if cfg["method"] == "ddtree":
            sizes = pp.ddtree_cudagraph_sizes(seqs, cfg["budget"], batched)
            kw["compilation_config"] = {"cudagraph_capture_sizes": sizes}
        else:
            kw["compilation_config"] = {"max_cudagraph_capture_size": 256}
    if cfg["method"]:
        sc = {"method": cfg["method"], "model": os.path.join(pair, "drafter"), "num_speculative_tokens": DEPTH}
        if cfg["budget"]:
            sc["ddtree_budget"] = cfg["budget"]
        kw["speculative_config"] = sc
    if cfg["sync"]:
        kw["async_scheduling"] = False
    if cfg["treeattn"]:
        kw["attention_backend"] = "TREE_ATTN"
    if cfg["method"] is None:
        kw["logprobs_mode"] = "raw_logits"  # the target's two best logits, as computed
    return kw


def break_walk() -> dict:
    """The broken variant: at every node with a child, 'the target chose' the first child's token.

    Returns its counts, which the run records: a broken run whose walk never ran, or never changed a
    choice, shows nothing about the test's power (``sabotage_engaged``)."""
    from vllm.v1.spec_decode import ddtree

    real = ddtree.walk_trees
    counts = {"walks": 0, "forced_nodes": 0}

    def walk_drafter_first(tree, target_tokens):
        forced = target_tokens.clone()
        tokens, parent = tree.tokens, tree.parent  # [R, N]
        for r in range(tokens.shape[0]):
            seen = set()
            for j in range(tokens.shape[1]):
                p = int(parent[r, j])
                if int(tokens[r, j]) >= 0 and p not in seen:
                    seen.add(p)
                    forced[r, p + 1] = tokens[r, j]
        counts["walks"] += 1
        counts["forced_nodes"] += int((forced != target_tokens).sum())
        return real(tree, forced.to(target_tokens.dtype))

    ddtree.walk_trees = walk_drafter_first
    return counts


def poison_drafter() -> dict:
    """Every third drafter pass, the first request's draft logits become NaN (``nan`` runs).
    Returns its counts, which the run records (``sabotage_engaged``)."""
    from vllm.model_executor.models import qwen3_dflash

    real = qwen3_dflash.DFlashQwen3ForCausalLM.compute_logits
    counts = {"drafter_passes": 0, "poisoned": 0}

    def compute_logits(self, hidden_states):
        logits = real(self, hidden_states)
        counts["drafter_passes"] += 1
        if logits is not None and counts["drafter_passes"] % 3 == 0:
            logits[:DEPTH] = float("nan")
            counts["poisoned"] += 1
        return logits

    qwen3_dflash.DFlashQwen3ForCausalLM.compute_logits = compute_logits
    return counts


def sabotage_engaged(run: dict) -> bool | None:
    """Whether a broken or nan run's sabotage changed anything (None: a run recorded before the counts)."""
    counts = run.get("sabotage")
    if counts is None:
        return None
    return counts.get("forced_nodes", 0) > 0 or counts.get("poisoned", 0) > 0


def stepwise(llm, prompts: list[list[int]], params, batch: int, continuous: bool = False) -> dict:
    """Token ids, new tokens per engine step (per request) and, with logprobs, the two best logits.

    The prompts run in groups of ``batch`` that start together, or, ``continuous``, with ``batch`` in
    flight and the next prompt added as soon as one finishes, as a server batches: new prompts are then
    prefilled in the same steps as the others' verification, which groups never do."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    engine = llm.llm_engine
    stamp = time.monotonic_ns()
    rids = [f"{stamp}-{i}" for i in range(len(prompts))]
    got: dict[str, tuple[list, list, list]] = {r: ([], [], []) for r in rids}
    waiting = iter(range(len(prompts)))

    def add(n: int) -> None:
        for i in itertools.islice(waiting, n):
            engine.add_request(rids[i], TokensPrompt(prompt_token_ids=prompts[i]), params)

    for _ in range(1 if continuous else math.ceil(len(prompts) / batch)):
        add(batch)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if continuous and out.finished:
                    add(1)
                o = out.outputs[0]
                new = list(o.token_ids)
                if not new:
                    continue
                t, s, lp = got[out.request_id]
                t += new
                s.append(len(new))
                if o.logprobs:
                    lp += [_best(step, tok) for step, tok in zip(o.logprobs, new, strict=True)]
    tokens, steps, top2 = ([got[r][k] for r in rids] for k in range(3))
    return {"tokens": tokens, "steps": steps, "top2": top2 if any(top2) else None}


def _best(step: dict, chosen: int) -> list[list[float]]:
    """The step's three best (token, logit): a three-way tie is judged like a two-way one."""
    return sorted(([int(t), float(lp.logprob)] for t, lp in step.items()), key=lambda x: (-x[1], x[0] != chosen))[:3]


def cmd_gen(a: argparse.Namespace) -> int:
    # The engine core runs in this process, whatever the caller's environment: the broken walk and the
    # poisoned drafter patch this process's modules, and vLLM starts a separate engine core by spawning
    # once CUDA is initialised (the hybrid's set-up initialises it), which would never see the patches.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = run_config(a.name)
    sabotage = break_walk() if cfg["broken"] else poison_drafter() if cfg["nan"] else None
    pair_prompts = json.loads(Path(a.pair, "prompts.json").read_text())
    prompts = pair_prompts["prompts"]
    kw = engine_kwargs(a.pair, cfg)
    t0 = time.time()
    llm = LLM(**kw)
    res: dict = {"name": a.name, "config": cfg, "kwargs": {k: str(v) for k, v in kw.items()}}
    res["init_s"] = round(time.time() - t0, 1)
    if sabotage is not None:
        res["sabotage"] = sabotage  # updated as the engine runs, written with every phase
    greedy = SamplingParams(
        temperature=0,
        max_tokens=GEN_TOKENS,
        ignore_eos=True,
        detokenize=False,
        logprobs=3 if cfg["method"] is None else None,
    )
    sampled = SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True, detokenize=False, **QWEN_SAMPLING)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(max_tokens=8, detokenize=False))
    phases = a.phases.split(",")
    spread = one_per_length(pair_prompts)
    ids = spread if mode_run(cfg) else list(range(len(prompts)))
    for phase, params, batches in (
        ("greedy", greedy, {"batch1": (ids, 1), "batch4": (spread, 4), "batch8": (ids, 8), "mixed": (ids, 8)}),
        ("sampled", sampled, {"batch1": (ids, 1), "batch8": (ids, 8)}),
    ):
        if phase not in phases:
            continue
        for key, (pids, b) in batches.items():
            t = time.time()
            m0 = pp_metrics(llm)
            out = stepwise(llm, [prompts[i] for i in pids], params, b, continuous=key == "mixed")
            out["prompt_ids"] = pids
            out["seconds"] = round(time.time() - t, 2)
            out["metrics"] = _pair_proof()._delta(pp_metrics(llm), m0)
            res[f"{phase}_{key}"] = out
            print(f"RUN {a.name} {phase} {key}: {out['seconds']}s", flush=True)
            _write(a.result, res)
    if "distribution" in phases:
        res["distribution"] = {}
        for label, sp in (("qwen", QWEN_SAMPLING), ("pure", PURE_SAMPLING)):
            params = SamplingParams(max_tokens=SAMPLED_TOKENS, ignore_eos=True, detokenize=False, **sp)
            per_prefix = []
            t = time.time()
            for prefix in pair_prompts["sampled_prefixes"]:
                outs = llm.generate([TokensPrompt(prompt_token_ids=prefix)] * SAMPLES, params, use_tqdm=False)
                per_prefix.append([list(o.outputs[0].token_ids) for o in outs])
            res["distribution"][label] = {"samples": per_prefix, "seconds": round(time.time() - t, 1)}
            print(f"RUN {a.name} distribution {label}: {time.time() - t:.0f}s", flush=True)
            _write(a.result, res)
    res["done"] = True
    _write(a.result, res)
    return 0


def pp_metrics(llm) -> dict:
    return _pair_proof()._metrics(llm)


def _write(path: str, res: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the reference
def cmd_reference(pair: str, out: str, budgets: list[int], device: str, decisions_only: bool) -> int:
    """The plain-PyTorch DDTree on the pair's prompts: its own greedy decode (``simulate``: the
    continuation, its accepted count per step; on a pure-attention target every step also verified
    under the ancestor-only mask), then ``decisions`` at every anchor of that continuation, which the
    engine's steps are judged against. ``decisions_only`` adds the decisions to a reference.json that
    has the continuations (no GPU needed)."""
    from ddtree.trained.reference import Pair

    os.makedirs(out, exist_ok=True)
    ref = Pair(pair, device)
    prompts = json.loads(Path(pair, "prompts.json").read_text())["prompts"]
    path = os.path.join(out, "reference.json")
    res = json.loads(Path(path).read_text()) if decisions_only else {"budgets": budgets, "prompts": []}
    methods = [None, *res["budgets"]]
    t0 = time.time()
    for i, p in enumerate(prompts):
        if decisions_only:
            if i >= len(res["prompts"]):
                break
            entry = res["prompts"][i]
        else:
            entry = ref.simulate(p, methods, GEN_TOKENS, mask_verify=ref.kind == "attention")
            res["prompts"].append(entry)
        entry["decisions"] = ref.decisions(p, entry["continuation"], methods)
        print(f"reference {i + 1}/{len(prompts)} ({time.time() - t0:.0f}s)", flush=True)
        _write(path, res)  # each prompt as it ends: a run cut by its time keeps what it did
    res["seconds"] = round(time.time() - t0, 1)
    res["done"] = True
    _write(path, res)
    return 0


# --------------------------------------------------------------------------- the verdicts
def method_name(cfg: dict) -> str:
    return "target" if cfg["method"] is None else "chain" if cfg["method"] == "dflash" else f"ddtree{cfg['budget']}"


def mode_run(cfg: dict) -> bool:
    """Runs that prove a mode (graphs, sync, the backends' noise, the NaN drafter) take one prompt of
    each length (``one_per_length``), so that all modes fit one GPU call; every run's batch 4 does too."""
    return cfg["graphs"] or cfg["sync"] or cfg["treeattn"] or cfg["nan"]


def one_per_length(pair_prompts: dict) -> list[int]:
    """The index of each length's first prompt (prompts are stored length by length)."""
    ids, start = [], 0
    for group in pair_prompts["by_length"]:
        chosen = len(group["chosen_min_gaps"])
        if chosen:
            ids.append(start)
        start += chosen
    return ids


def by_prompt(phase: dict, field: str = "tokens") -> dict[int, list]:
    """A phase's per-prompt lists keyed by prompt index (runs on a subset record ``prompt_ids``)."""
    values = phase.get(field) or []
    ids = phase.get("prompt_ids") or range(len(phase.get("tokens") or []))
    return dict(zip(ids, values, strict=False))


def mode_key(cfg: dict) -> str:
    return f"{cfg['dtype']}{'_graphs' if cfg['graphs'] else ''}"


GREEDY_KEYS = ("greedy_batch1", "greedy_batch4", "greedy_batch8", "greedy_mixed")


DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def gap_moves(a: dict, b: dict, dtype: str) -> Iterator[dict]:
    """How far two greedy phases of the target alone (two attention backends, or two batch shapes of one
    run) move the gap between its best logits: at every position of a prompt both ran that both computed
    from the same tokens (up to and including the first where their choices part), each phase's two best
    against the other's logits for those two tokens (both ways). Each move also in steps of the dtype
    at the larger of the position's logits: rounding moves a logit by steps of its own size."""
    pp = _pair_proof()
    toks_a, toks_b, top_a, top_b = by_prompt(a), by_prompt(b), by_prompt(a, "top2"), by_prompt(b, "top2")
    for i in sorted(toks_a.keys() & toks_b.keys() & top_a.keys() & top_b.keys()):
        parted = pp._first_diff(toks_a[i], toks_b[i])
        for j, (x, y) in enumerate(
            list(zip(top_a[i], top_b[i], strict=False))[: None if parted is None else parted + 1]
        ):
            step = pp.dtype_step(max(abs(v) for _, v in (*x, *y)), DTYPES[dtype])
            for u, v in ((x, y), (y, x)):
                gv = pp._gap(v, int(u[0][0]), int(u[1][0]))
                if gv is not None:
                    moved = abs(u[0][1] - u[1][1] - gv)
                    yield {"prompt": i, "at": j, "movement": moved, "steps": moved / step}


def kernel_noise(a: dict, b: dict, dtype: str = "bf16") -> float:
    """How far the target alone's two attention backends move the gap between its two best logits: the
    largest ``gap_moves`` over every greedy phase both ran (in logits)."""
    moves = (m["movement"] for key in GREEDY_KEYS if key in a and key in b for m in gap_moves(a[key], b[key], dtype))
    return max(moves, default=0.0)


def _largest_move(pairs: Iterable[tuple[str, str, dict, dict]], dtype: str) -> dict | None:
    """The largest move in dtype steps over (label, phase, phase a, phase b), with where it is."""
    best = None
    for label, phase, a, b in pairs:
        for m in gap_moves(a, b, dtype):
            if best is None or m["steps"] > best["steps"]:
                best = {"runs": label, "phases": phase} | m
    return best


def near_tie_noise(runs: dict[str, dict]) -> dict[str, dict]:
    """Per dtype, the near-tie rule's noise bound, in steps of the dtype at the departure's logits: the
    largest move of the gap between the target alone's best logits between configurations it
    legitimately ran: its two attention backends (each target run against its TREE_ATTN twin, same
    phase) and its own batch shapes (every target-alone run's batch 1, 4 and 8 against each other, on
    the prompts both ran), which of the two set it, and where."""
    targets = {n: r for n, r in runs.items() if "config" in r and r["config"]["method"] is None}
    plain = {
        mode_key(r["config"]): n for n, r in targets.items() if not r["config"]["treeattn"] and "greedy_batch1" in r
    }
    out: dict[str, dict] = {}
    for dtype in sorted({r["config"]["dtype"] for r in targets.values()}):
        mine = {n: r for n, r in targets.items() if r["config"]["dtype"] == dtype}
        backends = _largest_move(
            (
                (f"{plain[mode_key(r['config'])]} / {n}", key, runs[plain[mode_key(r["config"])]][key], r[key])
                for n, r in mine.items()
                if r["config"]["treeattn"] and mode_key(r["config"]) in plain
                for key in GREEDY_KEYS
                if key in r and key in runs[plain[mode_key(r["config"])]]
            ),
            dtype,
        )
        keys = {n: [k for k in GREEDY_KEYS if k in r] for n, r in mine.items()}
        batch = _largest_move(
            (
                (n, f"{k1} / {k2}", r[k1], r[k2])
                for n, r in mine.items()
                for x, k1 in enumerate(keys[n])
                for k2 in keys[n][x + 1 :]
            ),
            dtype,
        )
        steps = {"backends": backends["steps"] if backends else 0.0, "batch": batch["steps"] if batch else 0.0}
        bound = max(steps.values())
        out[dtype] = {
            "bound_steps": bound,
            "set_by": "none" if bound == 0 else max(steps, key=lambda k: (steps[k], k == "backends")),
            "backends": backends,
            "batch": batch,
        }
    return out


def judge_identity(ref: dict, run: dict, dtype: str, noise_steps: float = 0.0) -> dict:
    """Each output against the target alone's (same phase and batch): identical, or first departing at
    a near-tie of the target's two best logits (the rule of the random-pair proof: no wider than the
    target alone's legitimate configurations move such a gap, ``noise_steps`` steps of the dtype at
    those logits (``near_tie_noise``: its two attention backends and its own batch shapes), and at
    least one step). Only prompts whose target-alone output is real text are judged; the others are
    listed."""
    pp = _pair_proof()
    dt = DTYPES[dtype]
    out = {}
    for key in GREEDY_KEYS:
        if key not in ref or key not in run:
            continue
        departures, not_text = [], []
        ref_tokens, ref_top2, run_tokens = by_prompt(ref[key]), by_prompt(ref[key], "top2"), by_prompt(run[key])
        pairs = [(i, ref_tokens[i], b) for i, b in run_tokens.items() if i in ref_tokens]
        for i, a, b in pairs:
            if degenerate(a):
                not_text.append(i)
                continue
            d = pp._first_diff(a, b)
            if d is None:
                continue
            top2 = ref_top2.get(i, [])
            if d < min(len(top2), len(b)):
                noise = noise_steps * pp.dtype_step(max(abs(v) for _, v in top2[d]), dt)
                verdict = pp.divergence(top2[d], a[d], b[d], dt, noise) | {"noise": noise}
            else:
                verdict = {"near_tie": False, "why": "one of the two stopped early"}
            departures.append({"prompt": i, "at": d, **verdict})
        compared = len(pairs) - len(not_text)
        out[key] = {
            "compared": compared,
            "identical": compared - len(departures),
            "departures": departures,
            "only_near_ties": all(x["near_tie"] for x in departures),
            "left_out_target_not_real_text": not_text,
        }
    return out


def judge_reference(reference: dict, run: dict, method: str, dtype: str) -> dict:
    """The engine's accepted count at each batch-1 greedy step against the plain-PyTorch DDTree's at the
    same anchor (``reference.decide``: the same context, so the same tree up to rounding), over the steps
    before the engine's output departs from the reference's float32 continuation. A different count
    is a near-tie of the drafter when the draft-score margin that decided it is within the rounding
    of the engine's dtype: one step of the dtype at the drafter's logit scale per depth."""
    pp = _pair_proof()
    dt = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    steps_equal = steps_compared = 0
    mismatches = []
    run_steps = by_prompt(run["greedy_batch1"], "steps")
    for i, toks in by_prompt(run["greedy_batch1"]).items():
        if i >= len(reference["prompts"]) or i not in run_steps:
            continue
        ref, steps = reference["prompts"][i], run_steps[i]
        decisions = ref.get("decisions", {}).get(method)
        if decisions is None:
            continue
        depart = pp._first_diff(ref["continuation"], toks)
        anchor = 0  # the output index of the step's anchor (its last token before the step)
        for j, s in enumerate(steps[1:]):  # the first delta is the prefill's token
            e = s - 1
            if (depart is not None and anchor + e + 2 > depart) or anchor + e + 2 >= GEN_TOKENS:
                break  # past a departure, or the last step (max_tokens may cut it)
            d = decisions[anchor]
            steps_compared += 1
            if e == d["k"]:
                steps_equal += 1
            else:
                margin = d["outside"] if e > d["k"] else d["inside"][e]
                depth = min(e, d["k"]) + 1
                tie = margin is not None and margin <= depth * pp.dtype_step(DRAFT_LOGIT_SCALE, dt)
                mismatches.append(
                    {
                        "prompt": i,
                        "step": j,
                        "anchor": anchor,
                        "engine": e,
                        "reference": d["k"],
                        "margin": margin,
                        "near_tie": tie,
                    }
                )
            anchor += e + 1
    return {
        "steps_compared": steps_compared,
        "steps_equal": steps_equal,
        "mismatches": mismatches,
        "mismatch_margin_max": max((m["margin"] for m in mismatches if m["margin"] is not None), default=None),
        "equal": steps_compared > 0 and steps_equal == steps_compared,
        "equal_but_near_ties": steps_compared > 0 and all(m["near_tie"] for m in mismatches),
    }


def margin_quantiles(reference: dict, method: str) -> list[float] | None:
    """The smallest decisive margin of every anchor, at the 1st, 5th and 50th percentiles: how close
    the reference's decisions usually are (a mismatch's margin below these is rounding's)."""
    vals = []
    for p in reference["prompts"]:
        for d in p.get("decisions", {}).get(method, []):
            ms = [*d["inside"], *([d["outside"]] if d["outside"] is not None else [])]
            if ms:
                vals.append(min(ms))
    if not vals:
        return None
    vals.sort()
    return [round(vals[int(q * (len(vals) - 1))], 4) for q in (0.01, 0.05, 0.5)]


def real_text(run: dict, target: dict | None) -> dict:
    """Distinct tokens of the run's greedy outputs; the prompts whose target-alone output is not real
    text (identity is not judged there); and every output that is not real text where the target's
    is: one identical to the target's cannot be, one that departed (at a near-tie, judge_identity)
    continues other text, which may loop."""
    distinct = [len(set(t)) for t in run.get("greedy_batch1", {}).get("tokens", [])]
    failures, target_loops = [], set()
    for key in GREEDY_KEYS:
        if key not in run:
            continue
        own = by_prompt(run[key])
        ref_tokens = by_prompt((target or {}).get(key) or run[key])
        at_batch1 = by_prompt((target or {}).get("greedy_batch1") or {})
        for i, t in own.items():
            # the target alone's output for this prompt in this phase, else at batch 1, else the run's own
            ref = ref_tokens.get(i, at_batch1.get(i, t))
            if degenerate(ref):
                target_loops.add(i)
            elif why := degenerate(t):
                failures.append({"phase": key, "prompt": i, "why": why, "departed": t != ref})
    return {
        "outputs": len(distinct),
        "distinct_tokens_min_median": [min(distinct), sorted(distinct)[len(distinct) // 2]] if distinct else None,
        "target_not_real_text": sorted(target_loops),
        "not_real_text": failures,
    }


def summarise(pair: str, out: str) -> dict:
    runs = {}
    for f in sorted(Path(out).glob("*.json")):
        if f.name in ("summary.json", "reference.json", "mismatches.json"):
            continue
        try:
            runs[f.stem] = json.loads(f.read_text())
        except ValueError as e:
            runs[f.stem] = {"error": f"{f} is not whole JSON ({e})"}
            continue
        if "config" in runs[f.stem]:  # files of older runs lack the newer settings
            runs[f.stem]["config"] = run_config(f.stem) | runs[f.stem]["config"]
    reference = None
    if Path(out, "reference.json").exists():
        reference = json.loads(Path(out, "reference.json").read_text())
    summary: dict = {
        "runs": {},
        "identity": {},
        "real_text": {},
        "acceptance": {},
        "reference": {},
        "distribution": {},
        "sabotage": {},  # a broken walk or NaN drafter that changed nothing proves nothing
    }
    targets = {
        mode_key(r["config"]): r
        for r in runs.values()
        if "config" in r and r["config"]["method"] is None and not r["config"]["treeattn"] and "greedy_batch1" in r
    }
    noise = {}
    for r in runs.values():
        cfg = r.get("config", {})
        # a greedy TREE_ATTN run only: its _dist twin has no logits and would overwrite it with 0.0
        if cfg.get("treeattn") and mode_key(cfg) in targets and "greedy_batch1" in r:
            moved = kernel_noise(targets[mode_key(cfg)], r, cfg["dtype"])
            noise[cfg["dtype"]] = max(noise.get(cfg["dtype"], 0.0), moved)
    summary["kernel_noise"] = noise  # the two backends' movement alone, as the results of record have it
    # The near-tie rule's bound: the backends' and the target's own batch shapes' moves, per dtype.
    summary["near_tie_noise"] = near_tie_noise(runs)
    bound = {dtype: v["bound_steps"] for dtype, v in summary["near_tie_noise"].items()}
    for name, r in runs.items():
        summary["runs"][name] = {k: r.get(k) for k in ("init_s", "done", "error") if k in r} | {
            "seconds": {k: v.get("seconds") for k, v in r.items() if isinstance(v, dict) and "seconds" in v}
        }
        if "config" not in r:
            continue
        cfg = r["config"]
        if cfg["broken"] or cfg["nan"]:
            summary["sabotage"][name] = {"counts": r.get("sabotage"), "engaged": sabotage_engaged(r)}
        ref = targets.get(mode_key(cfg))
        summary["real_text"][name] = real_text(r, ref)
        if ref is not None and r is not ref and "greedy_batch1" in r and not cfg["treeattn"]:
            summary["identity"][name] = judge_identity(ref, r, cfg["dtype"], bound.get(cfg["dtype"], 0.0))
        for key in ("greedy_batch1", "greedy_batch8", "greedy_mixed", "sampled_batch1", "sampled_batch8"):
            if key in r and cfg["method"] is not None:
                summary["acceptance"].setdefault(name, {})[key] = acceptance(r[key]["steps"], GEN_TOKENS, DEPTH)
        # A nan run's drafter is broken on purpose every third pass: its steps are not the reference's.
        if (
            reference
            and cfg["method"] is not None
            and not cfg["nan"]
            and "greedy_batch1" in r
            and reference.get("prompts")
        ):
            summary["reference"][name] = judge_reference(reference, r, method_name(cfg), cfg["dtype"])
    if reference:
        summary["reference_mask_walk_mismatch"] = {
            m: sum(p["mask_walk_mismatch"][m] for p in reference["prompts"])
            for m in reference["prompts"][0]["mask_walk_mismatch"]
        }
        summary["reference_margin_quantiles"] = {
            m: margin_quantiles(reference, m) for m in reference["prompts"][0]["accepted_per_step"]
        }
        summary["reference_acceptance"] = {
            m: acceptance(
                [[1] + [k + 1 for k in p["accepted_per_step"][m]] for p in reference["prompts"]], GEN_TOKENS, DEPTH
            )
            for m in reference["prompts"][0]["accepted_per_step"]
        }
    # The target alone's samples per (dtype, attention backend). A speculative run is compared with the
    # target on the backend it verifies with where that ran (TREE_ATTN: only the tree differs), else on
    # FlashAttention; the target on TREE_ATTN against FlashAttention is the control (only rounding differs).
    near_ties = None
    if any("distribution" in r for r in runs.values()) and (
        got := sampled_near_ties(pair, runs, summary["near_tie_noise"])
    ):
        summary["sampled_prefix_top_p_margin"], near_ties = got
        summary["sampled_prefix_near_ties"] = near_ties
    bases = {
        (r["config"]["dtype"], r["config"]["treeattn"]): r
        for r in runs.values()
        if r.get("config", {}).get("method") is None and "distribution" in r
    }
    for name, r in runs.items():
        cfg = r.get("config", {})
        if "distribution" not in r or not cfg:
            continue
        if cfg["method"] is None:
            base = bases.get((cfg["dtype"], False)) if cfg["treeattn"] else None
        else:
            base = bases.get((cfg["dtype"], True)) or bases.get((cfg["dtype"], False))
        if base is not None and base is not r:
            near = None if near_ties is None else near_ties[cfg["dtype"]]
            summary["distribution"][name] = {
                label: judge_distribution(
                    base["distribution"][label]["samples"],
                    r["distribution"][label]["samples"],
                    None if near is None else near.get(label, []),
                )
                for label in r["distribution"]
                if label in base["distribution"]
            } | {"against": next(n for n, x in runs.items() if x is base)}
    return summary


def sampled_near_ties(pair: str, runs: dict[str, dict], noise: dict[str, dict]) -> tuple[list, dict] | None:
    """Per sampled prefix, the float32 target's first-token top-p margin (QWEN_SAMPLING), and per dtype
    of a sampled run and sampling setting the near-tie prefixes (``stats.near_tie_prefix``: a top-k
    logit moved by one step of the dtype, or by the near-tie bound, changes the kept set). None where
    the pair's target is not here to compute its logits."""
    if not Path(pair, "target").is_dir():
        return None
    pp = _pair_proof()
    logits = prefix_logits(pair)
    q = QWEN_SAMPLING
    margins = [round(kept_tokens(x, q["temperature"], q["top_k"], q["top_p"])[1], 4) for x in logits]
    near: dict[str, dict] = {}
    for dtype in sorted({r["config"]["dtype"] for r in runs.values() if "distribution" in r and "config" in r}):
        steps = max(1.0, noise.get(dtype, {}).get("bound_steps", 0.0))

        def move(x: float, dt: str = DTYPES[dtype], steps: float = steps) -> float:
            return steps * pp.dtype_step(x, dt)

        near[dtype] = {
            label: [{"prefix": k, **m} for k, x in enumerate(logits) if (m := near_tie_prefix(x, **sp, move=move))]
            for label, sp in SAMPLING.items()
        }
    return margins, near


PASS_P = 0.01  # a sampled run passes where no judged position's p is below this


def judge_distribution(base: list, run: list, near: list[dict] | None) -> dict:
    """The two-sample test of a sampled run against the target alone's samples: over every prefix (as
    recorded: nothing hidden), and summed over the prefixes but the near-tie ones (``near``: where
    rounding alone moves a token in or out of the first token's kept set), whose own p-values are listed.
    It passes where at least one prefix is judged and every judged position's p is above PASS_P. Where
    the near-tie prefixes are unknown (``near`` is None: the pair's target was not here) every prefix
    is judged."""
    raw = homogeneity(base, run)
    excluded = sorted(x["prefix"] for x in near or [])
    judged = homogeneity(base, run, excluded) if excluded else raw
    kept = [k for k in range(len(base)) if k not in excluded]
    return raw | {
        "near_tie_prefixes": near,
        "excluded_p_by_prefix": {str(k): raw["p_by_prefix"][k] for k in excluded},
        "judged": {
            "prefixes": kept,
            "by_position": judged["by_position"],
            "min_p": judged["min_p"],
            "log10_min_p": judged["log10_min_p"],
        },
        "passes": bool(kept) and judged["min_p"] is not None and judged["min_p"] > PASS_P,
    }


def prefix_logits(pair: str) -> list[list[float]]:
    """The float32 target's logits for the first token after each sampled prefix."""
    import torch

    if "torch._dynamo" not in sys.modules:
        # transformers' loading imports torch._dynamo, which refuses the sys.intern wrapper that
        # ansible-core installs where it is present (judging identity loaded module_utils): import it
        # with Python's own sys.intern, the wrapper keeps it as unpatched_implementation.
        wrapped = sys.intern
        sys.intern = getattr(wrapped, "unpatched_implementation", wrapped)
        try:
            import torch._dynamo
        finally:
            sys.intern = wrapped
    from ddtree.trained import models

    kind = json.loads(Path(pair, "build.json").read_text())["kind"]
    lm, head, _ = models.load_target(kind, os.path.join(pair, "target"))
    out = []
    for prefix in json.loads(Path(pair, "prompts.json").read_text())["sampled_prefixes"]:
        with torch.no_grad():
            out.append(head(lm(torch.tensor([prefix])).last_hidden_state[:, -1]).float()[0].tolist())
    return out


def write_summary(pair: str, out: str) -> int:
    s = summarise(pair, out)
    Path(out, "summary.json").write_text(json.dumps(s, indent=1))
    print(json.dumps({k: v for k, v in s.items() if k != "runs"}, indent=1)[:20000])
    return 0


def cut_phases(build: dict) -> list[str]:
    """The phases of a build that its deadline cut: such a build is not the one its seeds give."""
    return sorted(k for k in ("target", "drafter", "on_policy_text") if (build.get(k) or {}).get("stopped_early"))


def repeat_build(first: dict, second: dict) -> dict:
    """Whether a second build of the same pair (same command, same GPU model) wrote the same files:
    equal digests for every file either lists, and neither cut by its deadline."""
    a, b = first.get("sha256") or {}, second.get("sha256") or {}
    if not a or not b:
        raise ValueError("both build.json files need their files' sha256 (build.py writes them)")
    if first.get("kind") != second.get("kind"):
        raise ValueError(f"not builds of one pair: {first.get('kind')} and {second.get('kind')}")
    differing = sorted(f for f in a.keys() | b.keys() if a.get(f) != b.get(f))
    cut = sorted({*cut_phases(first), *cut_phases(second)})
    return {
        "sha256_equal": not differing,
        "differing": differing,
        "cut_by_deadline": cut,
        "repeats": not differing and not cut,
    }


def record(pair: str, summary: dict, meta: dict, second_build: dict | None = None) -> dict:
    """The result of record: what the docs cite, compact (lists of mismatches and departures cut to
    their first 10; every count kept). ``second_build``: another build's build.json of the same pair,
    compared file by file (``pair.repeat_build``)."""
    build = json.loads(Path(pair, "build.json").read_text())

    def cut(v: dict) -> dict:
        return {k: (x[:10] if isinstance(x, list) and k in ("mismatches", "departures") else x) for k, x in v.items()}

    return {
        **meta,
        "pair": {
            "kind": build["kind"],
            "corpus_sha256": build["corpus"]["corpus_sha256"],
            "tokenizer_sha256": build["corpus"]["tokenizer_sha256"],
            "target": build["target"],
            "drafter": {k: v for k, v in build["drafter"].items() if k not in ("config", "inferred")},
            "drafter_config": build["drafter"].get("config"),
            "on_policy_text": build.get("on_policy_text"),
            "build_seconds": build["seconds"],
            "gdn_kernel": build.get("gdn_kernel", "torch"),
            "nondeterministic_ops": build.get("nondeterministic_ops"),
            "sha256": build.get("sha256"),  # a rebuild with the same seeds and steps compares here
            **({"repeat_build": repeat_build(build, second_build)} if second_build is not None else {}),
        },
        "identity": {r: {b: cut(v) for b, v in x.items()} for r, x in summary["identity"].items()},
        "kernel_noise": summary.get("kernel_noise"),
        "near_tie_noise": summary.get("near_tie_noise"),
        "real_text": summary["real_text"],
        "acceptance": summary["acceptance"],
        "reference": {r: cut(v) for r, v in summary["reference"].items()},
        "reference_acceptance": {
            m: v["mean_acceptance_length"] for m, v in (summary.get("reference_acceptance") or {}).items()
        },
        "reference_margin_quantiles": summary.get("reference_margin_quantiles"),
        "reference_mask_walk_mismatch": summary.get("reference_mask_walk_mismatch"),
        "distribution": summary["distribution"],
        "sabotage": summary.get("sabotage", {}),
        "sampled_prefix_top_p_margin": summary.get("sampled_prefix_top_p_margin"),
        "sampled_prefix_near_ties": summary.get("sampled_prefix_near_ties"),
        "runs": {r: v for r, v in summary["runs"].items()},
    }


# --------------------------------------------------------------------------- the driver
DEFAULT_RUNS = [
    "target_bf16",
    "chain_bf16",
    "ddtree15_bf16",
    "ddtree32_bf16",
    "ddtree64_bf16",
    "target_fp16",
    "chain_fp16",
    "ddtree32_fp16",
]


def phases_for(name: str) -> str:
    cfg = run_config(name)
    if cfg["broken"] or cfg["dist"]:
        return "distribution"
    if cfg["method"] is None or cfg["treeattn"] or cfg["graphs"] or cfg["sync"] or cfg["nan"] or cfg["dtype"] != "bf16":
        return "greedy"  # the target alone accepts nothing: its sampled run would measure nothing
    return "greedy,sampled"


def cmd_driver(pair: str, out: str, runs: list[str], budget_s: float, reference: bool) -> int:
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    procs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if reference:
        log = open(os.path.join(out, "reference.log"), "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "ddtree.trained.proof", "reference", pair, out]
        procs.append(("reference", subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log))
    for name in runs:
        log = open(os.path.join(out, f"{name}.log"), "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "ddtree.trained.proof", "gen", pair, os.path.join(out, f"{name}.json"), name]
        cmd += ["--phases", phases_for(name)]
        procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log))
    for name, p, log in procs:
        try:
            p.wait(timeout=max(5, budget_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            print(f"{name}: stopped at the time budget", flush=True)
        log.close()
        print(f"{name}: rc={p.returncode} ({time.time() - t0:.0f}s)", flush=True)
    return write_summary(pair, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("gen")
    s.add_argument("pair")
    s.add_argument("result")
    s.add_argument("name")
    s.add_argument("--phases", default="greedy")
    s = sub.add_parser("reference")
    s.add_argument("pair")
    s.add_argument("out")
    s.add_argument("--budgets", type=int, nargs="*", default=[15, 32, 64])
    s.add_argument("--device", default="cuda")
    s.add_argument("--decisions-only", action="store_true", help="add decisions to OUT/reference.json")
    s = sub.add_parser("driver")
    s.add_argument("pair")
    s.add_argument("out")
    s.add_argument("--runs", nargs="*", default=DEFAULT_RUNS)
    s.add_argument("--budget-s", type=float, default=480)
    s.add_argument("--no-reference", action="store_true")
    s = sub.add_parser("summarise")
    s.add_argument("pair")
    s.add_argument("out")
    s = sub.add_parser("record", help="write the compact result of record from OUT/summary.json")
    s.add_argument("pair")
    s.add_argument("out")
    s.add_argument("result")
    s.add_argument("--gpu", required=True, help="the GPU, e.g. 'NVIDIA H100 80GB HBM3'")
    s.add_argument("--changeset", required=True, help="the change set's manifest sha256")
    s.add_argument("--command", required=True, help="how the runs were made")
    s.add_argument("--repeat-build", help="build.json of a second build of the same pair, to compare file by file")
    a = ap.parse_args()
    try:
        if a.cmd == "gen":
            return cmd_gen(a)
        if a.cmd == "reference":
            return cmd_reference(a.pair, a.out, a.budgets, a.device, a.decisions_only)
        if a.cmd == "driver":
            return cmd_driver(a.pair, a.out, a.runs, a.budget_s, not a.no_reference)
        if a.cmd == "record":
            summary = json.loads(Path(a.out, "summary.json").read_text())
            meta = {"hardware": a.gpu, "vllm": "0.20.1", "manifest_sha256": a.changeset, "command": a.command}
            second = json.loads(Path(a.repeat_build).read_text()) if a.repeat_build else None
            Path(a.result).write_text(json.dumps(record(a.pair, summary, meta, second), indent=1) + "\n")
            return 0
        return write_summary(a.pair, a.out)
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
