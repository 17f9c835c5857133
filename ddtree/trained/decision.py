"""DDTree against the chain at the real model's shapes: measured acceptance x measured step cost.

    python3 -m ddtree.trained.decision SUMMARY.json [--step-costs FILE ...] [--replay OUT.json]

A speculative step yields its accepted drafts plus one token, so a method serving ``b`` requests
at mean acceptance length ``L`` with ``t`` ms per verification step delivers

    tokens/s = b x L / t x 1000,   and DDTree over the chain = (L_ddtree / L_chain) x (t_chain / t_ddtree).

``L`` comes from a trained pair's engine runs (ddtree/trained/proof.py summary: greedy for
temperature 0, Qwen's sampling for 0.7; batch 1 and 8); ``t`` from the step-cost benchmark at
Qwen3.6-27B's shapes with random weights (ddtree/bench/step_cost.py results: the same engine and
change set, each method beside the chain in one run). Budget 15 takes budget 16's step cost (the
nearest measured, one node apart). A cell without both figures says so.

``--replay OUT.json`` writes the same figures per method for the lab's stand-in vLLM
(tests/fakes/inference_server.py), which serves each method at its measured mean acceptance length
and its measured step cost relative to the chain's, so the lab's tuning sees these ratios.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddtree import HOME

STEP_COST_FILES = ("step_cost_27b_budgets_h200.json", "step_cost_27b_h200.json")
STEP_COST_METHOD = {"chain": "chain", "ddtree15": "ddtree16", "ddtree32": "ddtree32", "ddtree64": "ddtree64"}


def default_step_costs() -> list[Path]:
    return [HOME / "results" / name for name in STEP_COST_FILES if (HOME / "results" / name).exists()]


def step_costs(files: list[Path], context: int) -> dict[tuple[str, int], tuple[float, str]]:
    """(method, batch) -> (ms per step, source file) at the given context; earlier files win."""
    out: dict[tuple[str, int], tuple[float, str]] = {}
    for f in files:
        for row in json.loads(f.read_text())["rows"]:
            key = (row["method"], int(row["batch"]))
            if int(row["context"]) == context and key not in out:
                out[key] = (float(row["ms_per_step"]), f.name)
    return out


def mean_lengths(summary: dict) -> dict[tuple[str, str, int], float]:
    """(method, temperature label, batch) -> mean acceptance length, from the bf16 eager runs."""
    out = {}
    for run, phases in summary["acceptance"].items():
        method, _, mode = run.partition("_")
        if mode != "bf16":
            continue
        for phase, a in phases.items():
            kind, _, batch = phase.partition("_batch")
            if not batch:  # greedy_mixed: no one batch size, so no step cost of record to pair it with
                continue
            temp = {"greedy": "T=0", "sampled": "T=0.7"}[kind]
            if a.get("mean_acceptance_length"):
                out[(method, temp, int(batch))] = a["mean_acceptance_length"]
    return out


def table(summary: dict, costs: dict) -> list[dict]:
    lengths = mean_lengths(summary)
    rows = []
    for temp in ("T=0", "T=0.7"):
        for batch in (1, 8):
            chain_len = lengths.get(("chain", temp, batch))
            chain_ms = costs.get(("chain", batch))
            for method in ("ddtree15", "ddtree32", "ddtree64"):
                length = lengths.get((method, temp, batch))
                ms = costs.get((STEP_COST_METHOD[method], batch))
                row = {"temperature": temp, "batch": batch, "method": method, "L_chain": chain_len, "L": length}
                row["t_chain_ms"] = chain_ms[0] if chain_ms else None
                row["t_ms"] = ms[0] if ms else None
                if None in (chain_len, length, row["t_chain_ms"], row["t_ms"]):
                    row["ddtree_over_chain"] = None
                else:
                    row["ddtree_over_chain"] = round(length / chain_len * row["t_chain_ms"] / row["t_ms"], 3)
                rows.append(row)
    return rows


def replay(summary: dict, costs: dict) -> dict:
    """Per method, temperature ("greedy", "sampled") and batch: the measured L and ms per step.

    The lab's stand-in engine reads this (tests/lab/labctl.py writes it onto each node); a cell
    holds None where that figure was not measured, and the stand-in takes the nearest measured one.
    """
    lengths = mean_lengths(summary)
    kinds = {"T=0": "greedy", "T=0.7": "sampled"}
    methods: dict[str, dict] = {}
    for method, cost_method in STEP_COST_METHOD.items():
        cells: dict[str, dict] = {}
        for temp, kind in kinds.items():
            for batch in (1, 8):
                length = lengths.get((method, temp, batch))
                ms = costs.get((cost_method, batch))
                cells.setdefault(kind, {})[str(batch)] = {
                    "mean_acceptance_length": length,
                    "ms_per_step": ms[0] if ms else None,
                }
        methods[method] = cells
    # How long the measured completions were: the stand-in's figures hold for requests this long.
    max_tokens = {a.get("max_tokens") for phases in summary["acceptance"].values() for a in phases.values()}
    max_tokens.discard(None)
    return {"methods": methods, "max_tokens": max(max_tokens) if max_tokens else None}


def markdown(rows: list[dict]) -> str:
    def f(v, nd=2):
        return "not measured" if v is None else f"{v:.{nd}f}"

    lines = [
        "| temperature | batch | DDTree budget | L chain | L DDTree | ms chain | ms DDTree | DDTree / chain |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ratio = "not measured" if r["ddtree_over_chain"] is None else f"{r['ddtree_over_chain']:.3f}x"
        lines.append(
            f"| {r['temperature']} | {r['batch']} | {r['method'][6:]} | {f(r['L_chain'])} | {f(r['L'])} | "
            f"{f(r['t_chain_ms'])} | {f(r['t_ms'])} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summary", type=Path, help="a trained pair's proof summary.json")
    ap.add_argument("--step-costs", type=Path, nargs="*", help="step_cost result files (default: the 27B ones)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--replay", type=Path, help="write the per-method figures the lab's stand-in vLLM serves at")
    a = ap.parse_args()
    files = a.step_costs or default_step_costs()
    if not files:
        raise SystemExit("no step-cost results found: give --step-costs FILE (ddtree/bench/step_cost.py writes them)")
    summary, costs = json.loads(a.summary.read_text()), step_costs(files, a.context)
    if a.replay:
        out = replay(summary, costs)
        out["source"] = {
            "acceptance": a.summary.name,
            "step_costs": [f.name for f in files],
            "context": a.context,
            "manifest_sha256": summary.get("manifest_sha256"),
        }
        tmp = a.replay.with_name(a.replay.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
        tmp.replace(a.replay)
        return 0
    rows = table(summary, costs)
    print(markdown(rows))
    print(f"\nstep costs at {a.context} tokens of context from: {', '.join(str(f) for f in files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
