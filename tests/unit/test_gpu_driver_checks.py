"""tests/gpu/ddtree_gpu.py's judgements, which the GPU runs' summaries rest on, on the CPU."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def ddtree_gpu(gpu_script):
    """The GPU driver's judgements, importable on the CPU."""
    return gpu_script("ddtree_gpu")


REFUSED = "DDTree tree verification (speculative method 'ddtree') cannot honour logprobs ..."


def test_ddtree_must_refuse_every_probe_and_the_others_serve_them(ddtree_gpu):
    probes = list(ddtree_gpu.REFUSAL_PROBES)
    assert ddtree_gpu.refusals_as_expected(True, dict.fromkeys(probes, REFUSED))["as_expected"]
    assert ddtree_gpu.refusals_as_expected(False, dict.fromkeys(probes, "served"))["as_expected"]
    one_served = {**dict.fromkeys(probes, REFUSED), probes[0]: "served"}
    assert not ddtree_gpu.refusals_as_expected(True, one_served)["as_expected"]
    assert not ddtree_gpu.refusals_as_expected(False, one_served)["as_expected"]
    assert not ddtree_gpu.refusals_as_expected(True, {probes[0]: REFUSED})["as_expected"]  # a probe missing


def test_identity_covers_the_allowed_token_run_when_both_sides_have_it(ddtree_gpu):
    ref = {"batch1": [[1, 2]], "batch4": [[1, 2]], "allowed_batch4": [[3, 3]]}
    same = ddtree_gpu.compare(ref, dict(ref))
    assert set(same) == {"batch1", "batch4", "allowed_batch4"}
    assert all(v["identical"] for v in same.values())
    other = ddtree_gpu.compare(ref, {**ref, "allowed_batch4": [[3, 4]]})
    assert other["allowed_batch4"] == {"identical": False, "first_divergence": [1]}
    assert set(ddtree_gpu.compare({"batch1": [], "batch4": []}, ref)) == {"batch1", "batch4"}


def _run(tokens: list[list[int]], **extra) -> dict:
    return {"batch1": tokens, "batch4": tokens, "batch1_tok_s": 10.0, "batch4_tok_s": 20.0, **extra}


def test_summarise_rebuilds_the_verdicts_from_the_runs_files(ddtree_gpu, tmp_path, capsys):
    out = tmp_path / "hy"
    out.mkdir()
    (out / "hy_target_fp16.json").write_text(json.dumps(_run([[1, 2, 3]])))
    (out / "hy_target_fp16.log").write_text("INFO backend FLASH_ATTN\n")
    tree = _run([[1, 2, 4]], mean_acceptance_length_batch1=3.0, mean_acceptance_length_batch4=2.5)
    (out / "hy_ddtree_b14_fp16.json").write_text(json.dumps(tree))
    (out / "hy_ddtree_b14_fp16.log").write_text("")
    (out / "hy_ddtree_b14_graphs_bf16.json").write_text('{"batch1": [[1, 2')  # cut off mid-write
    (out / "hy_ddtree_b14_graphs_bf16.log").write_text("Traceback\nRuntimeError: CUDA error\n")
    (out / "hy_target_graphs_bf16.log").write_text("killed\n")  # no result at all

    assert ddtree_gpu.cmd_summarise(str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    verdict = summary["lossless"]["hy_ddtree_b14_fp16_vs_hy_target_fp16"]
    assert verdict["batch4"] == {"identical": False, "first_divergence": [2]}
    assert summary["acceptance"] == {"hy_ddtree_b14_fp16": {"batch1": 3.0, "batch4": 2.5}}
    assert summary["runs"]["hy_target_fp16"]["log_notes"] == ["INFO backend FLASH_ATTN"]
    assert "not a whole JSON result" in summary["runs"]["hy_ddtree_b14_graphs_bf16"]["error"]
    assert summary["runs"]["hy_target_graphs_bf16"] == {"error": "rc=None", "log_tail": "killed\n"}
    assert "ERROR hy_ddtree_b14_graphs_bf16" in capsys.readouterr().out


def test_summarise_refuses_a_folder_without_runs(ddtree_gpu, tmp_path, capsys):
    assert ddtree_gpu.cmd_summarise(str(tmp_path)) == 2
    assert "holds no run's" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()
