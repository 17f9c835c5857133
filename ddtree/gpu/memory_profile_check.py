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

``fit`` proves service_swap's memory fit (module_utils/memory_fit.py) against vLLM on the GPU: it starts
vLLM at the Qwen3.6-27B shapes with the role's defaults (roles/service_swap and roles/shared_settings
defaults: max_model_len, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, the draft length,
the DDTree budget; tensor parallel 1; CUDA graphs as the role renders them; the dummy weights vLLM
reports stand for the checkpoints' sizes), reads what vLLM measured
(weights, the profile's peak, what it holds besides, the KV cache it sized and how many requests of
max_model_len it holds) and writes them beside the fit's figures for the same GPU and settings:

    python3 -m ddtree.gpu.memory_profile_check fit /tmp/out [--method ddtree|dflash] [--mamba-ssm-dtype float32]
    # writes /tmp/out/memory_fit_27b_<method>_<gpu>.json; exit 0 when every check in "checks" holds

Run it on an H100 (80 GB) and an H200 (141 GB). The checks: the KV cache one request needs is vLLM's to
the byte; the profile estimate is within 10% of vLLM's peak or above it; the reserve covers what vLLM
holds besides (non-torch memory, its CUDA-graph estimate, and what nvidia-smi counts beyond CUDA's total);
the fit admits no more requests than vLLM.
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


# The role defaults the fit proof runs at (literal values in the roles' defaults files).
FIT_DEFAULTS = {
    "roles/service_swap/defaults/main.yml": (
        "service_swap_max_model_len",
        "service_swap_max_num_seqs",
        "service_swap_max_num_batched_tokens",
        "service_swap_fit_reserve_mib",
    ),
    "roles/shared_settings/defaults/main.yml": (
        "shared_settings_gpu_memory_utilization",
        "shared_settings_num_speculative_tokens",
        "shared_settings_ddtree_budget",
    ),
}
# The profile estimate may be above vLLM's peak (the safe side) or at most this much below it.
PROFILE_TOLERANCE = 0.10


def role_defaults() -> dict:
    """The role's defaults the fit proof runs at, read from the defaults files."""
    import yaml

    out = {}
    for path, names in FIT_DEFAULTS.items():
        data = yaml.safe_load((REPO / path).read_text())
        out.update({name: data[name] for name in names})
    return out


def nvidia_smi_total_mib() -> int | None:
    """GPU 0's memory.total as nvidia-smi reports it (gpu_check's fact), or None."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, LC_ALL="C"),
        ).stdout
        return int(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def fit_checks(measured: dict, predicted: dict) -> dict:
    """The proof's verdicts, each a boolean (see the module's docstring). What vLLM holds besides weights,
    profile and KV cache counts against the reserve, with the share of memory nvidia-smi reports beyond
    what CUDA gives vLLM (the fit's budget is nvidia-smi's total x gpu_memory_utilization)."""
    besides = (
        measured["non_torch_bytes"]
        + measured["cudagraph_estimate_bytes"]
        + max(predicted["budget_bytes"] - measured["requested_bytes"], 0)
    )
    return {
        "request_bytes_equal": predicted["request_bytes"] == measured["request_bytes"],
        "profile_within_tolerance_or_above": predicted["profile_bytes"]
        >= (1 - PROFILE_TOLERANCE) * measured["profile_peak_bytes"],
        "reserve_covers_what_vllm_holds_besides": predicted["reserve_bytes"] >= besides,
        "fit_admits_no_more_than_vllm": predicted["fits"] <= measured["max_concurrency"],
    }


def fit_settings(defaults: dict, method: str) -> dict:
    """The settings the fit proof starts vLLM with and the fit counts with, from the role defaults: the chain
    verifies its depth per step, DDTree its budget."""
    depth = int(defaults["shared_settings_num_speculative_tokens"])
    return {
        "depth": depth,
        "budget": int(defaults["shared_settings_ddtree_budget"]) if method == "ddtree" else depth,
        "max_model_len": int(defaults["service_swap_max_model_len"]),
        "max_num_seqs": int(defaults["service_swap_max_num_seqs"]),
        "max_num_batched_tokens": int(defaults["service_swap_max_num_batched_tokens"]),
        "gpu_memory_utilization": float(defaults["shared_settings_gpu_memory_utilization"]),
        "reserve_mib": int(defaults["service_swap_fit_reserve_mib"]),
    }


def fit_engine_args(defaults: dict, method: str, target: Path, drafter: Path) -> dict:
    """vLLM's arguments for the fit proof: the role's settings, tensor parallel 1, DDTree's CUDA graphs as
    service_swap renders them (plugins/filter/ddtree_method.py), dummy weights."""
    from ddtree.bench import step_cost

    s = fit_settings(defaults, method)
    spec: dict = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": s["depth"]}
    compilation: dict = {}
    if method == "ddtree":
        spec.update(method="ddtree", ddtree_budget=s["budget"])
        compilation = {
            "cudagraph_capture_sizes": step_cost.ddtree_cudagraph_sizes(
                s["max_num_seqs"], s["budget"], s["max_num_batched_tokens"]
            )
        }
    return {
        "model": str(target),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": s["max_model_len"],
        "max_num_seqs": s["max_num_seqs"],
        "max_num_batched_tokens": s["max_num_batched_tokens"],
        "enable_prefix_caching": False,
        "gpu_memory_utilization": s["gpu_memory_utilization"],
        "speculative_config": spec,
        "compilation_config": compilation,
        **step_cost.shape_engine_args("27b"),
    }


def fit_prediction(
    target_cfg: dict, drafter_cfg: dict, measured: dict, defaults: dict, method: str, gpu_memory_mib: int, *, base
) -> dict:
    """What service_swap's fit (module_utils/memory_fit.py) says for the settings vLLM ran with: its figures in
    the names fit_checks compares with vLLM's. ``base`` is the rules of the release vLLM runs
    (module_utils/ddtree_base.py BaseRules), which lay the KV cache out.

    The weights are an input of the fit (safetensors headers on a node); here vLLM's own figure. How it splits
    between target and drafter does not matter: only the sum is subtracted."""
    from ddtree import repo

    mf = repo.module_util("memory_fit")
    s = fit_settings(defaults, method)
    fit = mf.memory_fit(
        target_cfg,
        drafter_cfg,
        target_weights=measured["weights_bytes"],
        drafter_weights=0,
        gpu_memory_mib=gpu_memory_mib,
        gpu_memory_utilization=s["gpu_memory_utilization"],
        tensor_parallel_size=1,
        max_model_len=s["max_model_len"],
        max_num_seqs=s["max_num_seqs"],
        max_num_batched_tokens=s["max_num_batched_tokens"],
        spec_tokens=s["budget"],
        depth=s["depth"],
        ddtree=method == "ddtree",
        reserve_mib=s["reserve_mib"],
        base=base,
    )
    return {
        "budget_bytes": fit.budget,
        "profile_bytes": fit.profile,
        "reserve_bytes": fit.reserve,
        "kv_available_bytes": fit.kv_available,
        "request_bytes": fit.request,
        "fits": fit.fits,
    }


def run_fit(out: Path, method: str, mamba_ssm_dtype: str | None) -> int:
    import torch
    import vllm
    from vllm import LLM

    from ddtree import bases, repo
    from ddtree.bench import step_cost

    mib = repo.module_util("memory_fit").MIB
    # The rules of the release that runs here (vLLM 0.20.1: ddtree/vllm-0.20.1/base.json), before the
    # minutes of start-up: a release without a base stops here, naming the bases there are.
    base = bases.rules(vllm.__version__)
    d = role_defaults()
    root = Path(tempfile.mkdtemp(prefix="memory_fit_"))
    target, drafter = step_cost.write_models("27b", root)
    if mamba_ssm_dtype:
        config = json.loads((target / "config.json").read_text())
        config["text_config"]["mamba_ssm_dtype"] = mamba_ssm_dtype
        (target / "config.json").write_text(json.dumps(config, indent=1))
    settings = fit_settings(d, method)
    llm = LLM(**fit_engine_args(d, method, target, drafter))

    def figures(worker):
        from vllm.v1.core.kv_cache_utils import _max_memory_usage_bytes_from_groups

        worker = getattr(worker, "worker", worker)
        runner = worker.model_runner
        config = runner.kv_cache_config
        request = _max_memory_usage_bytes_from_groups(worker.vllm_config, config.kv_cache_groups)
        group_size = max(len(g.layer_names) for g in config.kv_cache_groups)
        page = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        return {
            "weights_bytes": int(runner.model_memory_usage),
            "profile_peak_bytes": int(worker.peak_activation_memory),
            "non_torch_bytes": int(worker.non_torch_memory),
            "cudagraph_estimate_bytes": int(getattr(worker, "cudagraph_memory_estimate", 0) or 0),
            "requested_bytes": int(worker.requested_memory),
            "kv_available_bytes": int(worker.available_kv_cache_memory_bytes),
            "num_blocks": int(config.num_blocks),
            "request_bytes": int(request),
            "max_concurrency": int(config.num_blocks // -(-request // (group_size * page))),
        }

    measured = llm.collective_rpc(figures)[0]
    _free, total = torch.cuda.mem_get_info()
    smi_mib = nvidia_smi_total_mib() or total // mib
    target_cfg = json.loads((target / "config.json").read_text())
    drafter_cfg = json.loads((drafter / "config.json").read_text())
    predicted = fit_prediction(target_cfg, drafter_cfg, measured, d, method, smi_mib, base=base)
    gpu = torch.cuda.get_device_name(0)
    record = {
        "hardware": f"{gpu}, {smi_mib} MiB (nvidia-smi, what the role reads), {total // mib} MiB (torch)",
        "command": f"python3 -m ddtree.gpu.memory_profile_check fit OUT --method {method}"
        + (f" --mamba-ssm-dtype {mamba_ssm_dtype}" if mamba_ssm_dtype else ""),
        "settings": {
            **d,
            "method": method,
            "budget": settings["budget"],
            "tensor_parallel_size": 1,
            "vllm": vllm.__version__,
            "base": base.release,
        },
        "measured": measured,
        "predicted": predicted,
        "checks": fit_checks(measured, predicted),
    }
    out.mkdir(parents=True, exist_ok=True)
    tag = "h200" if "H200" in gpu else ("h100" if "H100" in gpu else "gpu")
    (out / f"memory_fit_27b_{method}_{tag}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return 0 if all(record["checks"].values()) else 1


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
    s = sub.add_parser("fit")
    s.add_argument("out", type=Path)
    s.add_argument("--method", choices=["ddtree", "dflash"], default="ddtree")
    s.add_argument("--mamba-ssm-dtype", choices=["float32"], default=None)
    a = ap.parse_args()
    if a.cmd == "fit":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return run_fit(a.out, a.method, a.mamba_ssm_dtype)
    if a.cmd == "case":
        a.dest.write_text(json.dumps(run_case(a.method, a.shape, a.dtype), indent=1))
        return 0
    return driver(a.out, a.shape, a.methods, a.dtype)


if __name__ == "__main__":
    sys.exit(main())
