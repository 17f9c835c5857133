"""service_swap's memory fit: do the target, the drafter, the KV cache and DDTree's per-node state fit the GPUs?

A thin wrapper around module_utils/memory_fit.py (the arithmetic, unit-tested against vLLM's own
figures) for roles/service_swap/tasks/memory_fit.yml, which runs it before SGLang is stopped. How the
KV cache is laid out is the deployed vLLM release's rule (``kv_layout`` in its base's descriptor
ddtree/vllm-<release>/base.json, read by module_utils/ddtree_base.py): ``vllm_version`` names the
release (without it, the engine's sole base), ``engine_home`` the folder of the bases (the
repository's ddtree/ by default). A release without a base gets the part of the fit that needs no
base's rule (module_utils/memory_fit.py's memory_fit says why): request and recurrent_state are then
None in parts_gib, and service_swap_result.skipped_checks names the KV cache check.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ansible.module_utils
from ansible import constants as C

for _p in [*(C.DEFAULT_MODULE_UTILS_PATH or []), str(Path(__file__).resolve().parents[2] / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.ddtree_base import BaseError, rules_for
from ansible.module_utils.memory_fit import GIB, MemoryFitError, fit_verdict, memory_fit
from ansible.module_utils.target_config import TargetConfigError

# Where service_swap's settings come from, named in the refusals.
SETTINGS = (
    "gpus",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "verify_tokens",
    "depth",
    "method",
    "reserve_mib",
    "lower",
)


def _gpu_mib(gpus: Any) -> Any:
    """The smallest memory_total_mib of the GPUs (vLLM needs the same on every one); the raw value for the
    arithmetic to refuse when it is not a list of GPU facts."""
    if not isinstance(gpus, list) or not gpus or not all(isinstance(g, Mapping) for g in gpus):
        return None
    sizes = [g.get("memory_total_mib") for g in gpus]
    return min(sizes) if all(isinstance(s, int) and not isinstance(s, bool) for s in sizes) else sizes[0]


def service_swap_memory_fit(
    target: Any,
    drafter: Any,
    target_weights: Any,
    drafter_weights: Any,
    settings: Mapping[str, Any],
    hostname: str = "the node",
    target_path: str = "config.json",
    drafter_path: str = "drafter config.json",
    vllm_version: str | None = None,
    engine_home: str | Path | None = None,
) -> dict[str, Any]:
    """``{"refuse": str, "note": str, "max_num_seqs": int, "parts_gib": {...}}`` for service_swap.

    ``settings``: the role's values by the names in SETTINGS (``gpus``: gpu_check's ``gpus``). An
    input the arithmetic cannot use (or a base descriptor it cannot read) refuses, naming it; it never raises.
    """
    missing = [name for name in SETTINGS if name not in settings]
    seqs = settings.get("max_num_seqs")
    if missing:
        return {"refuse": f"the memory fit cannot run: no {', '.join(missing)}", "note": "", "max_num_seqs": seqs}
    try:
        if not isinstance(drafter, Mapping):
            raise MemoryFitError(f"{drafter_path} holds {type(drafter).__name__}, not a JSON object")
        fit = memory_fit(
            target,
            drafter,
            target_weights=target_weights,
            drafter_weights=drafter_weights,
            gpu_memory_mib=_gpu_mib(settings["gpus"]),
            gpu_memory_utilization=settings["gpu_memory_utilization"],
            tensor_parallel_size=settings["tensor_parallel_size"],
            max_model_len=settings["max_model_len"],
            max_num_seqs=seqs,
            max_num_batched_tokens=settings["max_num_batched_tokens"],
            spec_tokens=settings["verify_tokens"],
            depth=settings["depth"],
            ddtree=settings["method"] == "ddtree",
            reserve_mib=settings["reserve_mib"],
            base=rules_for(engine_home, vllm_version),
            target_path=target_path,
            drafter_path=drafter_path,
        )
    except (MemoryFitError, TargetConfigError, BaseError) as exc:
        return {"refuse": f"the memory fit cannot run: {exc}", "note": "", "max_num_seqs": seqs}
    verdict = fit_verdict(fit, bool(settings["lower"]), int(settings["max_model_len"]), hostname)
    verdict["parts_gib"] = {
        name: None if value is None else round(value / GIB, 3)
        for name, value in (
            ("budget", fit.budget),
            ("weights_target", fit.weights_target),
            ("weights_drafter", fit.weights_drafter),
            ("profile", fit.profile),
            ("reserve", fit.reserve),
            ("kv_available", fit.kv_available),
            ("request", fit.request if fit.layout else None),
            ("recurrent_state", fit.state if fit.layout else None),
        )
    }
    verdict["fits"] = fit.fits
    return verdict


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"service_swap_memory_fit": service_swap_memory_fit}
