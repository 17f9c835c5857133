"""The tune role's decision: which measured speculative method a node serves (roles/tune).

Every candidate is the DFlash chain (``{"method": "dflash"}``) or a DDTree budget
(``{"method": "ddtree", "budget": 32}``), started behind service_swap's gates and benchmarked with
the bench prompt set. The rules, in one place:

- only a candidate that passed every gate and was measured at every declared concurrency
  (``tune_traffic``) can win (a failed one is never served);
- a candidate's score is the weighted mean, over the declared concurrencies, of its output tokens/s
  over the chain's at the same concurrency (so each weight means what the inventory says, whatever
  the tok/s at that concurrency is);
- a DDTree budget slower than the chain's tok/s x ``1 - margin`` at any declared concurrency is
  refused; the eligible one with the best score serves when that score is at least ``1 + margin``,
  otherwise the chain, so a node is never left slower than its chain beyond the margin;
- without a measured chain (it failed its gates), the candidate with the best score over the fastest
  that passed at each concurrency serves, and the reason says it was not compared with a chain;
- nothing passed: no winner (the swap has already put SGLang back).

``tune_inputs_digest`` names what a measurement depends on, so a node whose inputs did not change is
not measured again. ``tune_read_prompts``, ``tune_ddtree_unavailable``, ``tune_plan`` and
``tune_swap_serving`` turn what the role read (the prompt file, the node's change-set record and
target config, service_swap's local fact) into values or one sentence saying what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ansible.module_utils
from ansible import constants as C

for _p in [*(C.DEFAULT_MODULE_UTILS_PATH or []), str(Path(__file__).resolve().parents[2] / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.figures import figure_problem, is_number, positive_figure

CHAIN = "dflash"
TREE = "ddtree"
CANDIDATE_KEYS = {"method", "budget"}
TRAFFIC_KEYS = {"concurrency", "weight"}


def tune_candidate_name(candidate: Mapping[str, Any]) -> str:
    """'dflash' for the chain, 'ddtree-<budget>' for a DDTree budget."""
    if candidate.get("method") == TREE:
        return f"{TREE}-{candidate.get('budget')}"
    return str(candidate.get("method"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tune_candidate_problems(candidates: Any, num_speculative_tokens: int) -> list[str]:
    """One sentence per thing wrong with ``tune_candidates``; [] when they can be measured."""
    if not isinstance(candidates, Sequence) or isinstance(candidates, (str, bytes)) or not candidates:
        return [
            "tune_candidates must be a non-empty list such as [{method: dflash}, {method: ddtree, budget: 32}], "
            f"not {str(candidates)[:60]!r}"
        ]
    problems: list[str] = []
    names: list[str] = []
    for i, c in enumerate(candidates):
        where = f"tune_candidates[{i}]"
        if not isinstance(c, Mapping):
            problems.append(f"{where} is {str(c)[:60]!r}; each candidate is a mapping with a method (and a budget)")
            continue
        unknown = sorted(set(map(str, c)) - CANDIDATE_KEYS)
        if unknown:
            problems.append(f"{where} has unknown key(s) {', '.join(unknown)}; only method and budget are read")
        method = c.get("method")
        if method == CHAIN:
            if "budget" in c:
                problems.append(f"{where} is the DFlash chain, which has no budget: remove its budget")
        elif method == TREE:
            budget = c.get("budget")
            if not _is_int(budget):
                problems.append(f"{where} is a DDTree candidate without an integer budget (got {budget!r})")
            elif budget < int(num_speculative_tokens):
                problems.append(
                    f"{where} has budget {budget}, below shared_settings_num_speculative_tokens "
                    f"({num_speculative_tokens}): a DDTree budget is at least the tree's depth"
                )
        else:
            problems.append(f"{where} has method {method!r}; it must be dflash or ddtree")
        names.append(tune_candidate_name(c))
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        problems.append(f"tune_candidates lists {', '.join(twice)} more than once")
    if names.count(CHAIN) == 0:
        problems.append(
            "tune_candidates has no {method: dflash}: the chain is the yardstick (DDTree serves only when it "
            "beats it), so it must be measured; add it"
        )
    return problems


def tune_traffic_problems(traffic: Any, max_num_seqs: Any = None) -> list[str]:
    """One sentence per thing wrong with ``tune_traffic``; [] when every concurrency can be measured and weighed.

    ``max_num_seqs`` (service_swap_max_num_seqs): vLLM runs no more requests at once, so a concurrency above
    it would measure a queue, not that concurrency; None (or no whole number: service_swap's preflight names
    it) skips the rule.
    """
    try:
        seqs = int(str(max_num_seqs).strip()) if not isinstance(max_num_seqs, (bool, float)) else None
    except ValueError:
        seqs = None
    example = "[{concurrency: 1, weight: 1}, {concurrency: 8, weight: 2}]"
    if not isinstance(traffic, Sequence) or isinstance(traffic, (str, bytes)) or not traffic:
        return [f"tune_traffic must be a non-empty list such as {example}, not {str(traffic)[:60]!r}"]
    problems: list[str] = []
    seen: list[int] = []
    for i, entry in enumerate(traffic):
        where = f"tune_traffic[{i}]"
        if not isinstance(entry, Mapping):
            problems.append(
                f"{where} is {str(entry)[:60]!r}; each entry is a mapping such as {{concurrency: 8, weight: 2}}"
            )
            continue
        unknown = sorted(set(map(str, entry)) - TRAFFIC_KEYS)
        if unknown:
            problems.append(f"{where} has unknown key(s) {', '.join(unknown)}; only concurrency and weight are read")
        concurrency, weight = entry.get("concurrency"), entry.get("weight")
        if not _is_int(concurrency) or concurrency < 1:
            problems.append(
                f"{where} has concurrency {concurrency!r}; it must be a positive integer (requests in flight at once)"
            )
        elif concurrency in seen:
            problems.append(
                f"tune_traffic lists concurrency {concurrency} more than once; give each concurrency one weight"
            )
        else:
            seen.append(concurrency)
            if seqs is not None and concurrency > seqs:
                problems.append(
                    f"{where} has concurrency {concurrency}, more than service_swap_max_num_seqs={seqs} "
                    "requests vLLM runs at once; lower the concurrency or raise service_swap_max_num_seqs (as far as "
                    "service_swap's memory fit allows)"
                )
        if positive_figure(weight) is None:
            problems.append(
                f"{where} has weight {weight!r}; it must be a number above 0 (how much that concurrency counts)"
            )
    return problems


def tune_traffic_levels(traffic: Sequence[Mapping[str, Any]]) -> list[int]:
    """The declared concurrencies, smallest first: what every candidate is measured at."""
    return sorted(int(t["concurrency"]) for t in traffic)


def _level(levels: Any, concurrency: int) -> Mapping[str, Any]:
    for lv in levels if isinstance(levels, Sequence) else []:
        if isinstance(lv, Mapping) and lv.get("concurrency") == concurrency:
            return lv
    return {}


def _num(value: Any) -> float | None:
    """A figure read from a benchmark or a stored record: finite and above zero, else None (never inf or nan)."""
    return positive_figure(value)


def _ratios(row: Mapping[str, Any]) -> str:
    """'c=1 x1.150, c=8 x0.930': a row's tok/s over the chain's at each concurrency."""
    return ", ".join(f"c={lv['concurrency']} x{lv['vs_chain']:.3f}" for lv in row["levels"])


def _speeds(row: Mapping[str, Any]) -> str:
    """'c=1 100.0, c=8 600.0 tok/s': a row's output tokens/s at each concurrency."""
    return ", ".join(f"c={lv['concurrency']} {lv['tok_s']:.1f}" for lv in row["levels"]) + " tok/s"


def _refusal(row: Mapping[str, Any], margin: float) -> str:
    worst = min((lv for lv in row["levels"] if lv["concurrency"] in row["refused_at"]), key=lambda lv: lv["vs_chain"])
    return (
        f"at concurrency {worst['concurrency']} it is x{worst['vs_chain']:.3f} the chain, "
        f"more than the {margin:.0%} margin slower"
    )


def tune_choose(
    results: Sequence[Mapping[str, Any]], margin: float, traffic: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The winner among measured candidates for the declared traffic, why, and one row per candidate.

    ``results``: per candidate ``{"method", "budget", "status": "ok" | "failed" | "skipped", "reason",
    "levels"}`` where ``levels`` is openai_bench's list (``concurrency``, ``throughput_tok_s``,
    ``mean_acceptance_length``). ``traffic``: ``[{"concurrency": int, "weight": number}]`` (valid:
    ``tune_traffic_problems``). A candidate's score is the weighted mean, over the declared
    concurrencies, of its tok/s over the chain's tok/s at the same concurrency. A DDTree budget is
    eligible only when at no declared concurrency its tok/s is under the chain's x (1 - margin); the
    eligible one with the best score serves when that score is at least 1 + margin, else the chain.

    Returns ``{"winner": name | None, "method", "budget", "reason", "traffic", "margin", "rows"}``; each
    row has ``name, method, budget, status, levels`` (per declared concurrency: ``concurrency, tok_s,
    acceptance, vs_chain``), ``acceptance`` (at the smallest declared concurrency), ``vs_chain`` (the
    weighted score), ``refused_at`` (concurrencies where it is slower than the margin allows),
    ``chosen`` and ``note``.
    """
    margin = float(margin)
    weights = {int(t["concurrency"]): float(t["weight"]) for t in traffic}
    levels = sorted(weights)
    total = sum(weights.values())
    rows: list[dict[str, Any]] = []
    for r in results:
        measured = []
        note = ""
        for c in levels:
            lv = _level(r.get("levels"), c)
            tok_s = _num(lv.get("throughput_tok_s"))
            if r.get("status") == "ok" and not note and tok_s is None:
                if lv:
                    # 0.0 tok/s crashed the choice, Infinity won it (issue 43): such a figure is refused, not compared.
                    problem = figure_problem(lv.get("throughput_tok_s"), f"throughput at concurrency {c}")
                    note = f"measured, but its {problem}: not a speed to compare; measure again (tune_force=true)"
                else:
                    note = f"no figures at concurrency {c}"
            measured.append(
                {
                    "concurrency": c,
                    "tok_s": tok_s,
                    "acceptance": _num(lv.get("mean_acceptance_length")),
                    "vs_chain": None,
                }
            )
        ok = r.get("status") == "ok" and not note
        if not ok and not note:
            note = str(r.get("reason") or "no figures")
        status = "ok" if ok else ("skipped" if r.get("status") == "skipped" else "failed")
        if not ok:
            measured = [{"concurrency": c, "tok_s": None, "acceptance": None, "vs_chain": None} for c in levels]
        rows.append(
            {
                "name": tune_candidate_name(r),
                "method": r.get("method"),
                "budget": r.get("budget") if r.get("method") == TREE else None,
                "status": status,
                "levels": measured,
                "acceptance": measured[0]["acceptance"] if measured else None,
                "vs_chain": None,
                "refused_at": [],
                "chosen": False,
                "note": note,
            }
        )
    passed = [row for row in rows if row["status"] == "ok"]
    chain = next((row for row in passed if row["method"] == CHAIN), None)
    # Each tok/s over a reference at the same concurrency: the chain's, or without one the fastest
    # that passed there (a passed row's tok/s are finite and above zero, _num).
    reference = (
        {
            c: (chain["levels"][i]["tok_s"] if chain is not None else max(row["levels"][i]["tok_s"] for row in passed))
            for i, c in enumerate(levels)
        }
        if passed
        else {}
    )
    score: dict[str, float] = {}
    for row in passed:
        for lv in row["levels"]:
            ratio = lv["tok_s"] / reference[lv["concurrency"]]
            if chain is not None:
                lv["vs_chain"] = round(ratio, 3)
            if ratio < 1 - margin and chain is not None:
                row["refused_at"].append(lv["concurrency"])
        score[row["name"]] = (
            sum(weights[lv["concurrency"]] * lv["tok_s"] / reference[lv["concurrency"]] for lv in row["levels"]) / total
        )
        if chain is not None:
            row["vs_chain"] = round(score[row["name"]], 3)

    def best(rows_: list[dict[str, Any]]) -> dict[str, Any] | None:
        # The best score; on a tie the smaller budget (less memory), the chain first.
        return min(rows_, key=lambda row: (-score[row["name"]], row["budget"] or 0), default=None)

    if not passed:
        failed = "; ".join(f"{row['name']}: {row['note']}" for row in rows)
        lead = "no candidate passed" if any(row["status"] == "skipped" for row in rows) else "every candidate failed"
        winner, reason = None, f"{lead}, so none serves ({failed})"
    elif chain is None:
        winner = best(passed)
        chain_measured = any(r.get("method") == CHAIN and r.get("status") == "ok" for r in results)
        chain_why = "has no speed to compare" if chain_measured else "failed its gates"
        reason = (
            f"the DFlash chain {chain_why} ({next(r['note'] for r in rows if r['method'] == CHAIN)}), so "
            f"{winner['name']} serves as the candidate that passed with the best weighted tok/s ({_speeds(winner)}), "
            "not compared with a chain"
        )
    else:
        trees = [row for row in passed if row["method"] == TREE]
        for row in trees:
            if row["refused_at"]:
                row["note"] = f"refused: {_refusal(row, margin)}"
        eligible = best([row for row in trees if not row["refused_at"]])
        top = best(trees)
        refused = (
            f"; {top['name']}, weighted x{top['vs_chain']:.3f}, is refused: {_refusal(top, margin)}"
            if top is not None and top is not eligible and top["refused_at"]
            else ""
        )
        if eligible is not None and eligible["vs_chain"] >= 1 + margin:
            winner = eligible
            reason = (
                f"{eligible['name']} is weighted x{eligible['vs_chain']:.3f} the chain's tok/s ({_ratios(eligible)}), "
                f"at least the {margin:.0%} margin and within it at every concurrency{refused}"
            )
        elif trees:
            winner = chain
            if all(lv["vs_chain"] < 1 for row in trees for lv in row["levels"]):
                reason = (
                    f"the chain ({_speeds(chain)}) is the fastest at every concurrency; the best DDTree, "
                    f"{top['name']}, is weighted x{top['vs_chain']:.3f}"
                )
            elif eligible is None:
                reason = (
                    f"the chain ({_speeds(chain)}): every DDTree is more than the {margin:.0%} margin slower than it "
                    f"at some concurrency{refused}"
                )
            else:
                reason = (
                    f"the chain ({_speeds(chain)}): the best DDTree within the margin everywhere, {eligible['name']}, "
                    f"is weighted x{eligible['vs_chain']:.3f} ({_ratios(eligible)}), short of the {margin:.0%} margin"
                    f"{refused}"
                )
        else:
            winner = chain
            all_trees = [row for row in rows if row["method"] == TREE]
            skipped = [row for row in all_trees if row["status"] == "skipped"]
            if not all_trees:
                why = "tune_candidates lists no DDTree budget"
            elif len(skipped) == len(all_trees):
                why = f"no DDTree candidate was measured ({skipped[0]['note']})"
            else:
                why = "no DDTree candidate passed its gates"
            reason = f"the chain ({_speeds(chain)}): {why}"
    if winner is not None:
        winner["chosen"] = True
        winner["note"] = ""
    return {
        "winner": winner["name"] if winner else None,
        "method": winner["method"] if winner else None,
        "budget": winner["budget"] if winner else None,
        "reason": reason,
        "traffic": [{"concurrency": c, "weight": weights[c]} for c in levels],
        "margin": margin,
        "rows": rows,
    }


def tune_inputs_digest(inputs: Mapping[str, Any]) -> str:
    """SHA-256 of the inputs a measurement depends on, independent of key order."""
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def tune_read_prompts(text: Any, path: str) -> dict[str, Any]:
    """The prompt set from the file's text: ``{"prompts": [...], "problem": ""}``, or no prompts and one
    sentence naming the file and what is wrong (missing or empty, not JSON, not a list of strings)."""
    fix = "point tune_prompts_file at a JSON list of prompt strings such as playbooks/files/bench_prompts.json"
    if not isinstance(text, str) or not text.strip():
        return {"prompts": [], "problem": f"tune_prompts_file {path} is missing or empty on the controller: {fix}"}
    try:
        data = json.loads(text)
    except ValueError as e:
        return {"prompts": [], "problem": f"tune_prompts_file {path} is not JSON ({e}): {fix}"}
    if not isinstance(data, list) or not data:
        kind = type(data).__name__ if not isinstance(data, list) else "an empty list"
        return {"prompts": [], "problem": f"tune_prompts_file {path} holds {kind}, not a list of prompts: {fix}"}
    bad = [i for i, p in enumerate(data) if not isinstance(p, str) or not p.strip()]
    if bad:
        return {
            "prompts": [],
            "problem": f"tune_prompts_file {path} has entries that are not non-empty strings "
            f"(index {', '.join(map(str, bad[:5]))}): {fix}",
        }
    return {"prompts": data, "problem": ""}


def tune_ddtree_unavailable(
    patch_fallback_reason: Any, changeset_present: bool, venv: str, target_fallback_reason: Any
) -> str:
    """'' when DDTree candidates can run on the node; else why not, in a sentence.

    ``patch_fallback_reason``: ddtree_patch_fallback_reason where ddtree_patch ran in the play (None
    otherwise); ``target_fallback_reason``: ddtree_fallback_reason of the target's config.json (the
    same rule, for playbooks/tune.yml alone). Without the change set's record (vllm-changeset.json)
    the venv has no DDTree at all.
    """
    if isinstance(patch_fallback_reason, str) and patch_fallback_reason.strip():
        return patch_fallback_reason.strip()
    if not changeset_present:
        return (
            f"the DDTree change set is not applied to {venv} (no vllm-changeset.json): run site.yml "
            "(ddtree_patch with ddtree_patch_state present) to measure DDTree budgets"
        )
    return target_fallback_reason.strip() if isinstance(target_fallback_reason, str) else ""


def tune_plan(candidates: Sequence[Mapping[str, Any]], ddtree_unavailable: str) -> dict[str, Any]:
    """Which candidates to start (``measure``) and the records of those not measured (``skipped``):
    every DDTree candidate when DDTree cannot run on the node, with the reason."""
    if not ddtree_unavailable:
        return {"measure": list(candidates), "skipped": []}
    measure = [c for c in candidates if c.get("method") != TREE]
    skipped = [
        {
            "method": TREE,
            "budget": c.get("budget"),
            "status": "skipped",
            "reason": f"not measured: DDTree is not available on this node: {ddtree_unavailable}",
        }
        for c in candidates
        if c.get("method") == TREE
    ]
    return {"measure": measure, "skipped": skipped}


def tune_swap_serving(fact_text: Any) -> str:
    """What service_swap's local fact says serves ('vllm', 'sglang', 'none'); '' when absent or unreadable.

    ``fact_text`` is the fact's JSON text or its value already parsed (json_file_info's data)."""
    try:
        data = json.loads(fact_text) if isinstance(fact_text, str) else fact_text
    except ValueError:
        return ""
    serving = data.get("serving") if isinstance(data, Mapping) else None
    return serving if isinstance(serving, str) else ""


def tune_read_record(fact_text: Any) -> dict[str, Any]:
    """The node's recorded tuning (tune.fact): inputs_digest, inputs and results; {} when absent or unreadable
    (then the node is measured again, as if never tuned). ``fact_text``: JSON text or the value parsed."""
    try:
        data = json.loads(fact_text) if isinstance(fact_text, str) else fact_text
    except ValueError:
        return {}
    if not isinstance(data, Mapping) or not isinstance(data.get("inputs_digest"), str):
        return {}
    results = data.get("results")
    if not isinstance(results, list) or not all(isinstance(r, Mapping) for r in results):
        return {}
    if any(_refused_figure(r) for r in results):
        # Written before figures were checked where measured (issue 43): 0.0 or an overflowed
        # tok/s is no measurement, so the node is measured once more, and never records one again.
        return {}
    return dict(data)


def _refused_figure(result: Mapping[str, Any]) -> bool:
    """Whether a recorded candidate that passed holds a throughput that is not a finite figure above zero."""
    if result.get("status") != "ok":
        return False
    levels = result.get("levels")
    if not isinstance(levels, list) or not levels:
        return True
    return any(not isinstance(lv, Mapping) or _num(lv.get("throughput_tok_s")) is None for lv in levels)


def tune_order_results(results: Sequence[Mapping[str, Any]], candidates: Sequence[Mapping[str, Any]]) -> list:
    """The results in tune_candidates' order (measured and skipped ones are recorded apart)."""
    order = [tune_candidate_name(c) for c in candidates]
    return sorted(
        results, key=lambda r: order.index(tune_candidate_name(r)) if tune_candidate_name(r) in order else len(order)
    )


def _traffic_text(traffic: Any) -> str:
    """'1 (weight 1), 4 (weight 1), 8 (weight 2)': the declared traffic in a sentence."""
    return ", ".join(
        f"{t.get('concurrency')} (weight {t.get('weight'):g})" if is_number(t.get("weight")) else str(t)
        for t in traffic or []
        if isinstance(t, Mapping)
    )


def tune_plan_message(what: Mapping[str, Any]) -> str:
    """What tuning does on this node, in one sentence (roles/tune/tasks/service.yml).

    ``what``: measure (bool), check_mode, force, tuned_before (a record with an inputs digest
    exists), plan (tune_plan's), traffic (tune_traffic), ddtree_unavailable, digest, choice (the
    recorded choice; read only when not measuring).
    """
    if not what.get("measure"):
        choice = what.get("choice") or {}
        return (
            f"Already tuned with these inputs (digest {str(what.get('digest', ''))[:12]}): serves {choice.get('winner')}, "
            f"{choice.get('reason')}. -e tune_force=true measures again."
        )
    why = (
        "tune_force"
        if what.get("force")
        else ("inputs changed since the last tuning" if what.get("tuned_before") else "never tuned")
    )
    names = ", ".join(tune_candidate_name(c) for c in (what.get("plan") or {}).get("measure", []))
    traffic = what.get("traffic") or []
    levels = ", ".join(str(t.get("concurrency")) for t in traffic if isinstance(t, Mapping))
    text = (
        f"{'Would measure' if what.get('check_mode') else 'Measuring'} {names} at concurrency {levels} ({why}), "
        "each restarted behind the swap's gates, then serve the best weighted tok/s for the traffic "
        f"(concurrency {_traffic_text(traffic)})."
    )
    unavailable = what.get("ddtree_unavailable") or ""
    return f"{text} DDTree budgets not measured: {unavailable}." if unavailable else text


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "tune_candidate_name": tune_candidate_name,
            "tune_candidate_problems": tune_candidate_problems,
            "tune_choose": tune_choose,
            "tune_traffic_problems": tune_traffic_problems,
            "tune_traffic_levels": tune_traffic_levels,
            "tune_inputs_digest": tune_inputs_digest,
            "tune_read_prompts": tune_read_prompts,
            "tune_ddtree_unavailable": tune_ddtree_unavailable,
            "tune_plan": tune_plan,
            "tune_plan_message": tune_plan_message,
            "tune_swap_serving": tune_swap_serving,
            "tune_order_results": tune_order_results,
            "tune_read_record": tune_read_record,
        }
