"""Does vLLM's memory profile cover a DDTree step? (needs an NVIDIA GPU, vLLM 0.20.1 + the change set)

vLLM sizes the KV cache from the peak memory of one dummy forward and a dummy sampling of one row
per request (the worker's ``peak_activation_memory``). A tree step holds more vocabulary-sized
tensors than that: the target's logits at every request's root and nodes, the float32 temporaries
of sampling them, the drafter's logits at every depth. If the profile does not see them, a full
batch can run out of memory in the middle of a step on a node whose KV cache took the rest.

At Qwen3-8B shapes (random weights, eager, no CUDA graphs: the profile is taken before graphs are
captured) with 16 requests and budget 64, this compares what a worst-case step allocates above
what is already held (16 sampled requests with top-k, top-p and allowed token ids; every step
verifies 16 x 65 rows, as random weights accept nothing) with the profile of DDTree and with the
profile of the chain, which is what vLLM profiles without the change set's ``profile_step_memory``.

    python3 tests/gpu/memory_profile_check.py driver /tmp/out     # writes /tmp/out/memory_profile.json

Each engine runs in its own process (``case``), one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

BATCH = 16
BUDGET = 64
ALLOWED = 20_000  # allowed token ids per request: the allowed-token mask is on
CASES = {"chain": 0, "ddtree64": BUDGET}


def run_case(method: str) -> dict:
    import step_cost
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    root = Path(tempfile.mkdtemp(prefix="memory_profile_"))
    target, drafter = step_cost.write_models("8b", root)
    spec: dict = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": step_cost.DEPTH}
    if CASES[method]:
        spec.update(method="ddtree", ddtree_budget=CASES[method])
    llm = LLM(
        model=str(target),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=1024,
        max_num_seqs=BATCH,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        speculative_config=spec,
    )

    def profiled(worker):
        worker = getattr(worker, "worker", worker)
        return int(worker.peak_activation_memory)

    profile_bytes = llm.collective_rpc(profiled)[0]
    prompts = [TokensPrompt(prompt_token_ids=[(7 * r + i) % 50_000 for i in range(32)]) for r in range(BATCH)]
    params = SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        allowed_token_ids=list(range(ALLOWED)),
        max_tokens=24,
        ignore_eos=True,
        detokenize=False,
    )
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    step_bytes = torch.cuda.max_memory_allocated() - held
    return {
        "method": method,
        "profile_peak_bytes": profile_bytes,
        "step_peak_bytes": step_bytes,
        "tokens": [len(o.outputs[0].token_ids) for o in outputs],
    }


def driver(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    rows = {}
    for method in CASES:
        dest = out / f"memory_profile_{method}.json"
        log = out / f"memory_profile_{method}.log"
        with log.open("w") as f:
            rc = subprocess.run(
                [sys.executable, __file__, "case", method, str(dest)], stdout=f, stderr=subprocess.STDOUT, env=env
            ).returncode
        rows[method] = json.loads(dest.read_text()) if rc == 0 and dest.exists() else {"error": f"exit {rc}: see {log}"}
    tree, chain = rows["ddtree64"], rows["chain"]
    summary: dict = {"batch": BATCH, "budget": BUDGET, "cases": rows}
    if "error" not in tree and "error" not in chain:
        gib = 1 << 30
        summary.update(
            ddtree_step_peak_gib=round(tree["step_peak_bytes"] / gib, 3),
            ddtree_profile_peak_gib=round(tree["profile_peak_bytes"] / gib, 3),
            chain_profile_peak_gib=round(chain["profile_peak_bytes"] / gib, 3),
            # The check: the profile that sized the KV cache saw at least what a tree step takes.
            profile_covers_the_tree_step=tree["step_peak_bytes"] <= tree["profile_peak_bytes"],
            # Without profile_step_memory the profile is the chain's: did the step need more?
            step_needs_more_than_the_chains_profile=tree["step_peak_bytes"] > chain["profile_peak_bytes"],
            all_tokens=all(n == 24 for r in (tree, chain) for n in r["tokens"]),
        )
    (out / "memory_profile.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if summary.get("profile_covers_the_tree_step") and summary.get("all_tokens") else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("driver")
    s.add_argument("out", type=Path)
    s = sub.add_parser("case")
    s.add_argument("method", choices=sorted(CASES))
    s.add_argument("dest", type=Path)
    a = ap.parse_args()
    if a.cmd == "case":
        a.dest.write_text(json.dumps(run_case(a.method), indent=1))
        return 0
    return driver(a.out)


if __name__ == "__main__":
    sys.exit(main())
