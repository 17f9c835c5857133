"""ddtree/compact_results.py: results in git are compact summaries, and compacting keeps every figure."""

from __future__ import annotations

import json

from ddtree import HOME, compact_results

RESULTS = HOME / "results"


def test_every_result_of_record_is_compact() -> None:
    # ddtree/trained writes its own summaries (trained_*), the other results went through the tool.
    files = [p for p in sorted(RESULTS.glob("*.json")) if not p.name.startswith("trained_")]
    assert files
    assert compact_results.main(["--check", *map(str, files)]) == 0


def test_printed_configs_and_long_log_lines_go_and_every_figure_stays() -> None:
    config = "ModelConfig(model='/tmp/models/target', " + "x" * 400 + ")"
    raw = {
        "note": "the claim",
        "runs": {
            "ddtree_b16_bf16": {
                "kwargs": {
                    "max_num_seqs": 8,
                    "speculative_config": {"method": "ddtree", "target_model_config": config},
                },
                "mean_acceptance_length_batch1": 4.5536,
                "log_notes": ["INFO DDTree: budget 16 nodes, drafter depth 7.", "backed'>, " + config],
                "token_ids": [[1, 2, 3], [4, 5, 6]],
            }
        },
        "tiny": 1e-06,
    }
    out = compact_results.compact(json.dumps(raw, indent=1))
    data = json.loads(out)
    run = data["runs"]["ddtree_b16_bf16"]
    assert run["kwargs"] == {"max_num_seqs": 8, "speculative_config": {"method": "ddtree"}}
    assert run["log_notes"] == ["INFO DDTree: budget 16 nodes, drafter depth 7."]
    assert run["mean_acceptance_length_batch1"] == 4.5536 and data["tiny"] == 1e-06
    assert '"token_ids": [[1, 2, 3], [4, 5, 6]]' in out  # one line, not eight
    assert data["compacted"] == compact_results.COMPACTED
    assert compact_results.compact(out) == out  # compacting twice changes nothing


def test_a_result_without_printed_configs_is_only_reformatted() -> None:
    raw = json.dumps({"gpu": "NVIDIA H200", "ms": [0.5, 1.25]}, indent=1)
    assert compact_results.compact(raw) == '{\n "gpu": "NVIDIA H200",\n "ms": [0.5, 1.25]\n}\n'
