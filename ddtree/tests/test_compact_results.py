"""ddtree/compact_results.py: results in git are compact summaries, and compacting keeps every figure."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ddtree import HOME, compact_results

# The engine's results and the Ansible side's GPU checks (tests/gpu/results, serve/ included).
RESULT_FILES = sorted([*(HOME / "results").glob("*.json"), *(HOME.parent / "tests/gpu/results").rglob("*.json")])


def test_every_result_of_record_is_compact_and_complete() -> None:
    assert len(RESULT_FILES) > 30
    assert compact_results.main(["--check", *map(str, RESULT_FILES)]) == 0


@pytest.mark.parametrize("field", compact_results.RESULT_FIELDS)
def test_a_result_without_its_claim_gpu_change_set_or_command_fails(
    tmp_path: Path, field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "step_cost_27b_h200.json"
    data = json.loads((HOME / "results" / path.name).read_text())
    assert compact_results.main(["--check", str(_write(path, data))]) == 0
    for value in (None, "", " ", 7):  # absent, empty, blank, not text
        if value is None:
            del data[field]
        else:
            data[field] = value
        capsys.readouterr()
        assert compact_results.main(["--check", str(_write(path, data))]) == 1
        assert f"{path}: lacks {field}: add it" in capsys.readouterr().out
    assert compact_results.main([str(path)]) == 1  # rewriting does not make it complete


def test_an_input_names_the_result_beside_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hybrid_pair_models.json"
    data = json.loads((HOME / "results" / path.name).read_text())
    assert data["kind"] == "input" and data["result"] == "hybrid_pair_h200.json"
    assert compact_results.main(["--check", str(_write(path, data))]) == 1  # no result beside it
    assert "lacks result (no hybrid_pair_h200.json beside it)" in capsys.readouterr().out
    shutil.copy(HOME / "results" / data["result"], tmp_path)
    assert compact_results.main(["--check", str(path)]) == 0
    del data["note"]
    assert compact_results.main(["--check", str(_write(path, data))]) == 1
    assert "lacks note" in capsys.readouterr().out
    del data["kind"]  # not an input any more: a result, and it has none of a result's fields
    data["note"] = "the claim"
    assert compact_results.main(["--check", str(_write(path, data))]) == 1
    assert "lacks hardware, manifest_sha256, command" in capsys.readouterr().out


def _write(path: Path, data: dict) -> Path:
    path.write_text(compact_results.dumps(data) + "\n")
    return path


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


def test_long_text_without_a_printed_config_stays() -> None:
    message = "/dev/nvidia-uvm is missing: " + "pass it into the container. " * 20
    raw = json.dumps({"facts": {"device_nodes": [message]}, "log_notes": ["INFO ok", "x" * 400]})
    assert json.loads(compact_results.compact(raw)) == json.loads(raw)


def test_a_result_without_printed_configs_is_only_reformatted() -> None:
    raw = json.dumps({"gpu": "NVIDIA H200", "ms": [0.5, 1.25]}, indent=1)
    assert compact_results.compact(raw) == '{\n "gpu": "NVIDIA H200",\n "ms": [0.5, 1.25]\n}\n'
