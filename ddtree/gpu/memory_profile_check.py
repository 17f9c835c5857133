"""Does vLLM's memory profile cover a DDTree step? (needs an NVIDIA GPU, vLLM 0.20.1 + the change set)

vLLM sizes the KV cache from the peak memory of one dummy forward and a dummy sampling of one row
per request (the worker's ``peak_activation_memory``). A tree step holds more vocabulary-sized
tensors than that: the target's logits at every request's root and nodes, the float32 temporaries
of sampling them, the drafter's logits at every depth. If the profile does not see them, a full
batch can run out of memory in the middle of a step on a node whose KV cache took the rest.

At Qwen3-8B or Qwen3.6-27B shapes (random weights, eager, no CUDA graphs: the profile is taken
before graphs are captured) with 16 requests and budget 64, this compares what a worst-case step
allocates above what is already held (16 sampled requests with top-k, top-p and allowed token ids;
every step verifies 16 x 65 rows, as random weights accept nothing) with the profile of DDTree and
with the profile of the chain, which is what vLLM profiles without the change set's
``profile_step_memory``. What the profile allocated and keeps (the buffer of vLLM's Triton
top-k/top-p kernel) is held during the step too, so it counts on the step's side.

    python3 -m ddtree.gpu.memory_profile_check driver /tmp/out [--shape 27b] [--methods ddtree64] [--dtype float16]
    # writes /tmp/out/memory_profile_<shape>[_float16].json

In float16 the Qwen3.5/3.6 target keeps its captured hidden states in float32 (Gemma-style norms),
which the profile counts; ``--dtype float16`` checks that.

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

from ddtree import REPO

BATCH = 16
BUDGET = 64
ALLOWED = 20_000  # allowed token ids per request: the allowed-token mask is on
CASES = {"chain": 0, "ddtree64": BUDGET}
# Room for the KV cache beside the weights (27B: about 59 GB with the drafter).
MEMORY_UTILIZATION = {"8b": 0.5, "27b": 0.7}


def kept_by_profile_bytes() -> int:
    """What vLLM's sampler allocated during the profile and keeps for later steps."""
    from vllm.v1.sample.ops import topk_topp_triton

    return sum(t.numel() * t.element_size() for t in topk_topp_triton._TRITON_BUFFER_CACHE.values())


def run_case(method: str, shape: str, dtype: str) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ddtree.bench import step_cost

    root = Path(tempfile.mkdtemp(prefix="memory_profile_"))
    target, drafter = step_cost.write_models(shape, root)
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
        gpu_memory_utilization=MEMORY_UTILIZATION[shape],
        dtype=dtype,
        speculative_config=spec,
        **step_cost.shape_engine_args(shape),
    )

    def profiled(worker):
        worker = getattr(worker, "worker", worker)
        return int(worker.peak_activation_memory)

    profile_bytes = llm.collective_rpc(profiled)[0]
    kept_bytes = kept_by_profile_bytes()
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
        "shape": shape,
        "dtype": dtype,
        "profile_peak_bytes": profile_bytes,
        "kept_by_profile_bytes": kept_bytes,
        "step_peak_bytes": step_bytes,
        "tokens": [len(o.outputs[0].token_ids) for o in outputs],
    }


def summarise(shape: str, rows: dict, dtype: str = "bfloat16") -> dict:
    """The figures and the check: the profile that sized the KV cache saw at least what a tree step
    takes beside what the profile left allocated."""
    summary: dict = {"shape": shape, "dtype": dtype, "batch": BATCH, "budget": BUDGET, "cases": rows}
    tree, chain = rows.get("ddtree64", {}), rows.get("chain")
    if "error" in tree or not tree:
        return summary
    gib = 1 << 30
    needed = tree["step_peak_bytes"] + tree["kept_by_profile_bytes"]
    summary.update(
        ddtree_step_peak_gib=round(tree["step_peak_bytes"] / gib, 3),
        ddtree_kept_by_profile_gib=round(tree["kept_by_profile_bytes"] / gib, 3),
        ddtree_profile_peak_gib=round(tree["profile_peak_bytes"] / gib, 3),
        margin_gib=round((tree["profile_peak_bytes"] - needed) / gib, 3),
        profile_covers_the_tree_step=needed <= tree["profile_peak_bytes"],
        all_tokens=all(n == 24 for r in rows.values() for n in r.get("tokens", [])),
    )
    if chain and "error" not in chain:
        summary.update(
            chain_profile_peak_gib=round(chain["profile_peak_bytes"] / gib, 3),
            # Without profile_step_memory the profile is the chain's: did the step need more?
            step_needs_more_than_the_chains_profile=needed > chain["profile_peak_bytes"],
        )
    return summary


def driver(out: Path, shape: str, methods: list[str], dtype: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    tag = shape if dtype == "bfloat16" else f"{shape}_{dtype}"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    rows = {}
    for method in methods:
        dest = out / f"memory_profile_{tag}_{method}.json"
        log = out / f"memory_profile_{tag}_{method}.log"
        with log.open("w") as f:
            rc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ddtree.gpu.memory_profile_check",
                    "case",
                    method,
                    str(dest),
                    "--shape",
                    shape,
                    "--dtype",
                    dtype,
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            ).returncode
        rows[method] = json.loads(dest.read_text()) if rc == 0 and dest.exists() else {"error": f"exit {rc}: see {log}"}
    summary = summarise(shape, rows, dtype)
    (out / f"memory_profile_{tag}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if summary.get("profile_covers_the_tree_step") and summary.get("all_tokens") else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("driver")
    s.add_argument("out", type=Path)
    s.add_argument("--methods", nargs="+", choices=sorted(CASES), default=list(CASES))
    s = sub.add_parser("case")
    s.add_argument("method", choices=sorted(CASES))
    s.add_argument("dest", type=Path)
    for s in sub.choices.values():
        s.add_argument("--shape", choices=sorted(MEMORY_UTILIZATION), default="8b")
        s.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    a = ap.parse_args()
    if a.cmd == "case":
        a.dest.write_text(json.dumps(run_case(a.method, a.shape, a.dtype), indent=1))
        return 0
    return driver(a.out, a.shape, a.methods, a.dtype)


if __name__ == "__main__":
    sys.exit(main())
