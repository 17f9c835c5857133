"""service_swap's checks in words: what is missing, which device nodes the service user cannot
open, why the acceptance gate failed. Each sentence tells the operator what is wrong and what to
do; the role's tasks only say which check they make (tests/unit/test_swap_gates.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ansible.module_utils
from ansible import constants as C

for _p in [*(C.DEFAULT_MODULE_UTILS_PATH or []), str(Path(__file__).resolve().parents[2] / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.ddtree_base import ENGINE_HOME, BaseError, release_of, releases, rules_for


def service_swap_missing_paths(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Of a stat loop over ``{path, what, executable}`` items, each path not in place, with what it is
    and what to do: absent, or (where ``executable``) not executable."""
    missing = []
    for result in results:
        item = result.get("item") or {}
        stat = result.get("stat") or {}
        present = bool(stat.get("exists")) and (bool(stat.get("executable")) or not item.get("executable"))
        if not present:
            missing.append(f"{item.get('path')} ({item.get('what')})")
    return missing


def service_swap_device_problem(found: Sequence[Any], blocked: Sequence[str], host: str, user: str) -> str:
    """Why the service user cannot reach the GPUs: no /dev/nvidia* nodes at all, or root-group nodes
    closed to others ('' when neither)."""
    if not found:
        return f"No /dev/nvidia* device nodes on {host}: the GPUs are not passed into the container (run gpu_check)."
    if blocked:
        return (
            f"GPU device nodes {', '.join(blocked)} are root-group and not world read-write, so the {user} user cannot"
            " open them: give them a dedicated group (e.g. a udev rule or the container mount) or mode 0666."
        )
    return ""


def service_swap_acceptance_problem(probe: Mapping[str, Any], floor: Any, requests: Any) -> str:
    """Why gate 3 failed: no drafts on /metrics (speculative decoding is not running), or a mean
    acceptance length under the floor with the counts it came from."""
    mean = probe.get("mean_acceptance_length")
    if mean is None:
        return "vLLM reports no spec-decode drafts on /metrics: speculative decoding is not running"
    spec = probe.get("spec_decode") or {}
    return (
        f"mean acceptance length {mean} over {requests} requests is under the floor service_swap_min_acceptance_length"
        f" {floor} (1 + {spec.get('accepted_tokens')} accepted / {spec.get('drafts')} drafts): the drafter runs but its"
        " drafts are rejected (wrong drafter config, target_layer_ids, or an unpatched vLLM layer offset)"
    )


def service_swap_gpus_busy_problem(facts: Mapping[str, Any], max_used_mib: Any, timeout_s: Any) -> str:
    """Why the GPUs did not count as free after SGLang stopped (nvidia_gpu_facts' result): MiB used
    per GPU, what holds them, what to do; or why the GPUs could not be read at all."""
    gpus = facts.get("gpus") or []
    if not ((facts.get("nvidia_smi") or {}).get("ok") and gpus):
        problems = facts.get("problems") or [facts.get("msg") or "nvidia_gpu_facts failed"]
        return "Cannot read the GPUs to see whether they are free: " + " ".join(str(p) for p in problems)
    holders = facts.get("holders") or {}
    used = ", ".join(f"{g.get('index')}: {g.get('memory_used_mib')}" for g in gpus)
    apps = ", ".join(str(a.get("process_name")) for a in holders.get("compute_apps") or []) or "none listed"
    local = ", ".join(str(h["unit"]) for h in holders.get("local") or [] if h.get("unit")) or "none"
    return (
        f"The GPUs were not free {timeout_s}s after SGLang stopped: MiB used per GPU {used} (must be under"
        f" {max_used_mib}); compute apps: {apps}; local holders: {local}. Stop what holds them (nvidia-smi,"
        " fuser -v /dev/nvidia*) and re-run."
    )


def service_swap_draft_slots_problem(
    max_num_seqs: Any,
    verify_tokens: Any,
    max_num_batched_tokens: Any,
    method: str,
    vllm_version: str | None = None,
    engine_home: str | Path | None = None,
) -> str:
    """Why vLLM would refuse the scheduler limits ('' when it would not): it reserves batched-token
    slots per sequence for drafting (by the deployed release's base: vLLM 0.20.1, ``verify_tokens - 1``),
    and their sum over max_num_seqs must stay below max_num_batched_tokens. '' where the release has no
    base (its rule is not known here: service_swap_skipped_checks says so); the engine's sole base
    without a ``vllm_version``."""
    base = rules_for(engine_home, vllm_version)
    if base is None:
        return ""
    seqs, tokens = int(max_num_seqs), int(max_num_batched_tokens)
    per_seq = base.draft_slots(int(verify_tokens))
    slots = seqs * per_seq
    if tokens > slots:
        return ""
    return (
        'vLLM would refuse to start ("max_num_scheduled_tokens ... does not allow any tokens to be scheduled"): it'
        f" reserves {per_seq} batched-token slots per sequence for {method} drafting, so service_swap_max_num_seqs"
        f" ({seqs}) x {per_seq} = {slots} must stay below service_swap_max_num_batched_tokens ({tokens}). Raise"
        f" service_swap_max_num_batched_tokens above {slots}, or lower service_swap_max_num_seqs,"
        " num_speculative_tokens or the DDTree budget."
    )


def service_swap_budget_problem(budget: Any, shared_budget: Any, num_speculative_tokens: Any) -> str:
    """Why the DDTree budget the unit would get is refused ('' when it is empty or at least the tree's
    depth, num_speculative_tokens); named as the inventory's shared_settings_ddtree_budget, or as the
    budget roles/tune chose or is measuring when it is not that one."""
    if budget in (None, "") or _int(budget) >= _int(num_speculative_tokens):
        return ""
    name = (
        "shared_settings_ddtree_budget"
        if budget == shared_budget
        else "The DDTree budget roles/tune chose or is measuring"
    )
    return (
        f"{name} is {budget}, below shared_settings_num_speculative_tokens ({num_speculative_tokens}): a DDTree budget"
        " is at least the tree's depth; raise it or leave it empty."
    )


# The rule as vLLM 0.20.1 writes it (vllm/config/vllm.py, VllmConfig._set_cudagraph_sizes, the default
# performance mode; the base's cudagraphs.capture_size.grid holds the grid as data):
#     max_cudagraph_capture_size = min(max_num_tokens, max_cudagraph_capture_size)  # max_num_batched_tokens
#     cudagraph_capture_sizes = [i for i in [1, 2, 4] if i <= max_cudagraph_capture_size]
#     if max_cudagraph_capture_size >= 8:
#         cudagraph_capture_sizes += list(range(8, min(max_cudagraph_capture_size + 1, 256), 8))
#     if max_cudagraph_capture_size >= 256:
#         cudagraph_capture_sizes += list(range(256, max_cudagraph_capture_size + 1, 16))
#     if max_num_tokens <= max_cudagraph_capture_size and max_num_tokens not in cudagraph_capture_sizes:
#         cudagraph_capture_sizes.append(max_num_tokens)
#     ...
#     valid_max_size = cudagraph_capture_sizes[-1] if cudagraph_capture_sizes else 0
#     ...  logger.warning("Truncating max_cudagraph_capture_size to %d", valid_max_size)
# So a cap at or above max_num_batched_tokens is lowered to max_num_batched_tokens, which is then
# captured itself, off the grid or not; only a cap under it is cut down to the grid. Without a cap (0,
# or auto where no uniform DDTree batch fits and nothing is rendered) vLLM's default, min(2 x
# max_num_seqs x a request's tokens, 512), is lowered the same way; that default cut to the grid holds
# a request of up to 512 tokens, so there only max_num_batched_tokens can fall short. Not checked: a
# request of more tokens (a DDTree budget of 512 or more) without a cap, which vLLM refuses; its 512 is
# not in the base's data. Rendered sizes (auto) are at most max_num_batched_tokens and kept as given.
# Then CompilationConfig.adjust_cudagraph_sizes_for_spec_decode rounds each size up to a multiple of a
# request's tokens, drops those over valid_max_size and raises "No valid cudagraph sizes after
# rounding" when none is left and one request's tokens exceed it.
def service_swap_capture_size_problem(
    capture_size: Any,
    verify_tokens: Any,
    max_num_batched_tokens: Any,
    vllm_version: str | None = None,
    engine_home: str | Path | None = None,
) -> str:
    """Why the deployed vLLM release would refuse its CUDA-graph sizes ('' when it would not). The release
    lowers the largest size it captures to ``max_num_batched_tokens`` (service_swap_max_num_batched_tokens)
    where that is at or under the cap (service_swap_max_cudagraph_capture_size, or vLLM's default for auto
    and 0), and cuts a cap other than 0 under it down to the largest size of its grid at or under the cap;
    what is left must hold the tokens its base asks for (``cudagraphs.capture_size`` in
    ddtree/vllm-<release>/base.json; vLLM 0.20.1: one request's verified tokens and its root, else no full
    decode graph is left, "No valid cudagraph sizes after rounding"). The sentence says which setting
    lowered it, what vLLM would capture, and the values that start. ``vllm_version`` names the release (the
    engine's sole base without it; '' where it has no base, whose rules are not known here),
    ``engine_home`` the folder of the bases (the repository's ddtree/ by default). A capture size that is
    neither auto nor a whole number is the preflight's own rule's to refuse ('' here)."""
    size = str(capture_size).strip()
    if size != "auto" and not re.fullmatch(r"[0-9]+", size):
        return ""
    base = rules_for(engine_home, vllm_version)
    if base is None:
        return ""
    verify = int(verify_tokens)
    need = base.capture_tokens(verify)
    requests = base.capture_min_requests
    who = "one request verifies" if requests == 1 else f"{requests} requests verify"
    tokens = _whole(max_num_batched_tokens)
    if tokens is None or tokens < 1:
        shown = str(max_num_batched_tokens)
        shown = shown if len(shown) <= 40 else f"{shown[:20]}... ({len(shown)} characters)"
        return (
            f"service_swap_max_num_batched_tokens is {shown}; it must be a whole number of tokens, at least"
            f" {max(need, 1)}."
        )
    if need == 0:
        return ""
    cap = _whole(size) if size != "auto" else 0
    if cap is None:
        return f"service_swap_max_cudagraph_capture_size has {len(size)} digits; use auto, 0 or a number of tokens."
    smallest = base.min_capture_size(verify)
    if cap and tokens > cap:
        captured = base.grid_at_or_under(cap)
        if captured >= need:
            return ""
        why = (
            f"service_swap_max_cudagraph_capture_size is {cap}: vLLM {base.release} cuts it down to the largest size"
            f" of its grid ({base.grid_words()}) at or under it and captures CUDA graphs of at most {captured} tokens,"
        )
    else:
        if tokens >= need:
            return ""
        origin = (
            f"service_swap_max_cudagraph_capture_size {cap}"
            if cap
            else f"its default, as service_swap_max_cudagraph_capture_size is {size}"
        )
        why = (
            f"service_swap_max_num_batched_tokens is {tokens}: vLLM {base.release} lowers the largest CUDA graph it"
            f" captures to max_num_batched_tokens (from {origin}) and captures CUDA graphs of at most {tokens} tokens,"
        )
    fixes = []
    if cap and cap < smallest:
        fixes.append(
            f"Use auto (one graph per batch), 0 (vLLM's default) or at least {smallest}, the smallest grid size that"
            f" holds {need} tokens."
        )
    if tokens < need:
        fixes.append(f"Raise service_swap_max_num_batched_tokens to at least {need}.")
    return f"{why} less than the {need} tokens {who} per step, so it would refuse to start. {' '.join(fixes)}"


def service_swap_ddtree_base_problem(method: str, vllm_version: str, engine_home: str | Path | None = None) -> str:
    """Why DDTree is refused on ``vllm_version`` ('' for the DFlash chain, or where the release has a base):
    without a base the project has no change set for that release (ddtree_patch refuses it), so vLLM there
    would not verify trees."""
    if method != "ddtree" or rules_for(engine_home, vllm_version) is not None:
        return ""
    known = ", ".join(releases(engine_home or ENGINE_HOME)) or "none"
    return (
        f"service_swap_spec_method is ddtree, but this project's DDTree change set has no base for vLLM "
        f"{release_of(vllm_version)} (no ddtree/vllm-{release_of(vllm_version)}/base.json; bases: {known}), so "
        "ddtree_patch cannot patch it and vLLM there verifies no trees. Use dflash on this release, or set "
        "shared_settings_vllm_version to a release with a base."
    )


# The checks that need a base's rules, as service_swap_result.skipped_checks names them, with what each
# compares; service_swap_skipped_checks lists those not run on a release without a base.
BASE_CHECKS = {
    "draft_slots": "service_swap_max_num_batched_tokens against the batched-token slots vLLM reserves per sequence "
    "for drafting (scheduler)",
    "capture_size": "service_swap_max_cudagraph_capture_size and service_swap_max_num_batched_tokens against the CUDA "
    "graph sizes the release captures (its size grid, lowered to max_num_batched_tokens)",
    "memory_fit_kv_cache": "how many requests of service_swap_max_model_len the KV cache holds (its layout); the "
    "weights and the profile run's peak are still checked against the GPU's memory",
}


def service_swap_skipped_checks(vllm_version: str, engine_home: str | Path | None = None) -> list[dict[str, str]]:
    """The preflight's checks not run because ``vllm_version`` has no base descriptor, each as ``{check,
    what, why}`` (service_swap_result.skipped_checks, the preflight's note); [] where the release has a
    base. A descriptor that is there but broken gives []: the checks themselves then
    refuse, naming the file."""
    try:
        if rules_for(engine_home, vllm_version) is not None:
            return []
    except BaseError:
        return []
    release = release_of(vllm_version)
    why = (
        f"vLLM {release} has no base descriptor in ddtree/: its scheduler/CUDA-graph/KV rules are not known "
        "here; vLLM checks them at start, and the health gate rolls back if it refuses"
    )
    return [{"check": name, "what": what, "why": why} for name, what in BASE_CHECKS.items()]


def service_swap_no_previous_unit(previous_unit_path: str, host: str) -> str:
    """Why rollback_to=previous_vllm refuses when swap.yml never kept an earlier unit."""
    return (
        f"No previous vLLM unit on {host} ({previous_unit_path} is missing): service_swap keeps the unit a changed one"
        " replaced only after the new unit passed its gates while the old one served healthily, so there is no earlier"
        " vLLM this node served from. Nothing was changed. Go back to SGLang instead with -e rollback_to=sglang."
    )


def service_swap_previous_exec_problem(previous_unit_path: str, executable: str, host: str) -> str:
    """Why rollback_to=previous_vllm refuses when the previous unit's vLLM venv was pruned."""
    return (
        f"The previous vLLM unit {previous_unit_path} runs {executable or 'no ExecStart'}, which is not an executable"
        f" on {host} (vllm_install keeps vllm_install_keep_venvs venvs and removes older ones). Nothing was changed."
        " Go back to SGLang with -e rollback_to=sglang, or reinstall that vLLM version with vllm_install."
    )


def service_swap_previous_plan(
    needed: bool, previous_unit_path: str, unit_path: str, executable: str, vllm_unit: str
) -> str:
    """What rollback_to=previous_vllm would do, for --check: restart from the previous unit behind the
    gates, or nothing when vLLM already serves healthily from it."""
    if not needed:
        return f"{vllm_unit} already serves from the previous unit; nothing to do."
    return (
        f"Would put {previous_unit_path} in place as {unit_path} (runs {executable}), restart {vllm_unit} and gate it"
        " on /health, a completion and the acceptance length; on failure put SGLang back."
    )


def _int(value: Any) -> int:
    """Jinja's ``| int``: a number, else 0."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _whole(value: Any) -> int | None:
    """A whole number given as one (an int, or text of digits with an optional sign), else None: not
    a bool, a fraction, other text, or more digits than Python reads."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    text = str(value).strip() if isinstance(value, str) else ""
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() reads (sys.get_int_max_str_digits)
        return None


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "service_swap_missing_paths": service_swap_missing_paths,
            "service_swap_device_problem": service_swap_device_problem,
            "service_swap_draft_slots_problem": service_swap_draft_slots_problem,
            "service_swap_acceptance_problem": service_swap_acceptance_problem,
            "service_swap_gpus_busy_problem": service_swap_gpus_busy_problem,
            "service_swap_budget_problem": service_swap_budget_problem,
            "service_swap_capture_size_problem": service_swap_capture_size_problem,
            "service_swap_ddtree_base_problem": service_swap_ddtree_base_problem,
            "service_swap_skipped_checks": service_swap_skipped_checks,
            "service_swap_no_previous_unit": service_swap_no_previous_unit,
            "service_swap_previous_exec_problem": service_swap_previous_exec_problem,
            "service_swap_previous_plan": service_swap_previous_plan,
        }
