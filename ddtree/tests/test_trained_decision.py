"""The decision table: measured acceptance x measured step cost (ddtree/trained/decision.py)."""

from __future__ import annotations

import json

from ddtree.trained import decision


def _summary(lengths: dict[str, dict[str, float]]) -> dict:
    return {
        "acceptance": {
            run: {phase: {"mean_acceptance_length": v} for phase, v in phases.items()}
            for run, phases in lengths.items()
        }
    }


def test_ratio_is_acceptance_times_step_cost(tmp_path):
    costs = tmp_path / "costs.json"
    rows = [
        {"method": "chain", "batch": 1, "context": 512, "ms_per_step": 25.0},
        {"method": "ddtree16", "batch": 1, "context": 512, "ms_per_step": 27.5},
        {"method": "ddtree16", "batch": 1, "context": 8192, "ms_per_step": 99.0},
    ]
    costs.write_text(json.dumps({"rows": rows}))
    summary = _summary(
        {
            "chain_bf16": {"greedy_batch1": 2.0, "greedy_mixed": 7.0},  # mixed has no one batch size
            "ddtree15_bf16": {"greedy_batch1": 2.5, "greedy_mixed": 7.0},
            "ddtree15_fp16": {"greedy_batch1": 9.0},  # only bf16 eager runs count
        }
    )
    table = decision.table(summary, decision.step_costs([costs], 512))
    row = next(r for r in table if (r["temperature"], r["batch"], r["method"]) == ("T=0", 1, "ddtree15"))
    assert row["ddtree_over_chain"] == round(2.5 / 2.0 * 25.0 / 27.5, 3)
    missing = next(r for r in table if (r["temperature"], r["batch"], r["method"]) == ("T=0", 1, "ddtree32"))
    assert missing["ddtree_over_chain"] is None
    assert "not measured" in decision.markdown(table)
