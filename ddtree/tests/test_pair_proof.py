"""ddtree/gpu/pair_proof.py's judgements, which the GPU runs' summaries rest on, on the CPU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def ddtree_gpu():
    """The GPU driver's judgements, importable on the CPU."""
    from ddtree.gpu import pair_proof

    return pair_proof


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


def test_dtype_step_is_the_spacing_of_the_dtypes_values(ddtree_gpu):
    assert ddtree_gpu.dtype_step(30.0, "bfloat16") == 0.125  # [16, 32): 2**4 / 2**7
    assert ddtree_gpu.dtype_step(-32.0, "bfloat16") == 0.25
    assert ddtree_gpu.dtype_step(0.53, "bfloat16") == 2**-8
    assert ddtree_gpu.dtype_step(30.0, "float16") == 2**-6
    assert ddtree_gpu.dtype_step(1.0, "float32") == 2**-23


STEP = 2**-8  # one bf16 step at the logits below (0.5-1)


def _target(top2_at_divergence: list[list[float]]) -> dict:
    """The target alone: five tokens, its two best logits at each; the fifth is where a run departs."""
    tokens = [[39, 1, 39, 1, 39]]
    steps = [[[t, 0.75], [40 - t, 0.5]] for t in tokens[0][:4]]
    return {
        "kwargs": {"dtype": "bfloat16"},
        "batch1": tokens,
        "batch4": tokens,
        "top2_batch4": [[*steps, top2_at_divergence]],
    }


def _departs(ddtree_gpu, ref: dict, run_token: int, noise: float = 0.0) -> dict:
    verdict = ddtree_gpu.compare(ref, {"batch1": ref["batch1"], "batch4": [[39, 1, 39, 1, run_token]]}, noise)
    assert verdict["batch1"] == {"identical": True, "first_divergence": [None]}
    assert verdict["batch4"]["first_divergence"] == [4]
    return verdict["batch4"]


@pytest.mark.parametrize(
    ("top2", "run_token", "near_tie"),
    [
        ([[39, 0.53125], [1, 0.53125]], 1, True),  # equal in bf16: the order is the rounding's
        ([[39, 0.53125 + STEP], [1, 0.53125]], 1, True),  # adjacent bf16 values
        ([[39, 0.53125 + 3 * STEP], [1, 0.53125]], 1, False),  # three steps: a clear choice, a real departure
        ([[39, 0.53125], [1, 0.53125]], 7, False),  # a tie between 39 and 1 excuses neither choosing 7
        ([[7, 0.53125], [1, 0.53125]], 1, False),  # the target's own token is not among the two: bad data
        ([[39, 0.53125], [1, 0.53125], [7, 0.53125]], 7, True),  # a three-way tie, recorded: the rounding's
        ([[39, 0.53125 + 3 * STEP], [1, 0.53125], [7, 0.53125]], 7, False),  # third, three steps below
    ],
)
def test_a_divergence_is_excused_only_at_a_near_tie_of_the_dtype(ddtree_gpu, top2, run_token, near_tie):
    b4 = _departs(ddtree_gpu, _target(top2), run_token)
    assert b4["identical"] is False
    assert b4["divergences"][0]["near_tie"] is near_tie
    assert b4["only_near_ties"] is near_tie


def test_divergences_are_listed_per_prompt_and_survive_json(ddtree_gpu):
    ref = _target([[39, 0.53125], [1, 0.53125]])
    ref = {**ref, "batch4": ref["batch4"] * 2, "top2_batch4": ref["top2_batch4"] * 2}
    run = {"batch1": ref["batch1"], "batch4": [ref["batch4"][0], [39, 1, 39, 1, 1]]}
    b4 = json.loads(json.dumps(ddtree_gpu.compare(ref, run)))["batch4"]
    assert b4["divergences"][0] is None and b4["divergences"][1]["near_tie"] is True
    short = {"batch1": ref["batch1"], "batch4": [ref["batch4"][0], [39, 1, 39, 1]]}  # stopped a token early
    b4 = ddtree_gpu.compare(ref, short)["batch4"]
    assert b4["divergences"][1] == {"near_tie": False, "why": "one of the two stopped early"}
    assert b4["only_near_ties"] is False


def test_without_the_targets_logits_a_divergence_is_only_reported(ddtree_gpu):
    ref = {k: v for k, v in _target([[39, 0.5], [1, 0.5]]).items() if k != "top2_batch4"}
    b4 = ddtree_gpu.compare(ref, {"batch1": ref["batch1"], "batch4": [[39, 1, 39, 1, 1]]})["batch4"]
    assert b4 == {"identical": False, "first_divergence": [4]}


def test_top2_reads_the_two_best_logits_of_each_step(ddtree_gpu):
    lp = SimpleNamespace
    steps = [
        {39: lp(logprob=30.25), 1: lp(logprob=30.5)},
        {1: lp(logprob=2.0), 39: lp(logprob=1.0), 7: lp(logprob=0.5)},
    ]
    out = SimpleNamespace(logprobs=steps, token_ids=[1, 1])
    assert ddtree_gpu._top2(out) == [[[1, 30.5], [39, 30.25]], [[1, 2.0], [39, 1.0]]]
    # Equal logits: the token the target chose comes first, whatever the order vLLM listed them in.
    tied = SimpleNamespace(logprobs=[{1: lp(logprob=0.5), 39: lp(logprob=0.5)}], token_ids=[39])
    assert ddtree_gpu._top2(tied) == [[[39, 0.5], [1, 0.5]]]


def test_top2_is_refused_where_there_are_no_greedy_target_logits(ddtree_gpu, monkeypatch):
    monkeypatch.setattr(
        "sys.argv", ["ddtree_gpu.py", "gen", "--result", "r", "--model", "m", "--method", "ddtree", "--top2"]
    )
    with pytest.raises(SystemExit, match="drop --method"):
        ddtree_gpu.main()


def test_kernel_noise_is_the_largest_move_of_the_gap_between_two_target_backends(ddtree_gpu):
    fa = _target([[39, 0.53125 + 2 * STEP], [1, 0.53125]])
    fa["top2_batch1"] = fa["top2_batch4"]
    # TREE_ATTN puts the fifth step's two logits 5 steps apart (fa: 2): the gap moves by 3 steps.
    ta = {**fa, "top2_batch4": [[*fa["top2_batch4"][0][:4], [[39, 0.53125 + 5 * STEP], [1, 0.53125]]]]}
    assert ddtree_gpu.kernel_noise(fa, ta) == 3 * STEP
    # At the first position where the backends choose differently both still read the same tokens:
    # it counts, with the gap signed for the first backend's pair (here TREE_ATTN has 1 ahead by a step).
    parted = {
        **fa,
        "batch4": [[39, 1, 39, 1, 1]],
        "top2_batch4": [[*fa["top2_batch4"][0][:4], [[1, 0.53125 + STEP], [39, 0.53125]]]],
    }
    assert ddtree_gpu.kernel_noise(fa, parted) == 3 * STEP
    # Past that point their logits say nothing of rounding: a sixth step after parting is ignored.
    longer = {k: [v[0] + [v[0][-1]]] for k, v in fa.items() if k != "kwargs"}
    later = {k: [v[0] + [v[0][-1]]] for k, v in parted.items() if k != "kwargs"}
    later["top2_batch4"][0][-1] = [[39, 0.9], [1, 0.1]]
    assert ddtree_gpu.kernel_noise(longer, later) == 3 * STEP
    assert ddtree_gpu.kernel_noise(fa, {"batch1": [], "batch4": []}) == 0.0


@pytest.mark.parametrize(("noise", "near_tie"), [(3 * STEP, True), (2 * STEP, True), (1.5 * STEP, False), (0.0, False)])
def test_a_two_step_gap_is_a_near_tie_only_where_the_kernels_move_it_that_far(ddtree_gpu, noise, near_tie):
    ref = _target([[39, 0.53125 + 2 * STEP], [1, 0.53125]])
    assert _departs(ddtree_gpu, ref, 1, noise)["only_near_ties"] is near_tie


def test_summarise_judges_a_runs_divergence_by_the_noise_of_the_same_run(ddtree_gpu):
    fa = _target([[39, 0.53125 + 2 * STEP], [1, 0.53125]])  # two bf16 steps apart where DDTree departs
    fa["top2_batch1"] = fa["top2_batch4"]
    ta = {**fa, "top2_batch4": [[*fa["top2_batch4"][0][:4], [[39, 0.53125 + 5 * STEP], [1, 0.53125]]]]}
    tree = {"batch1": fa["batch1"], "batch4": [[39, 1, 39, 1, 1]]}
    summary = ddtree_gpu.summarise({"target_fa_bf16": fa, "target_tree_attn_bf16": ta, "ddtree_b16_bf16": tree}, 1.0)
    assert summary["kernel_noise"] == {"bf16": 3 * STEP}
    assert summary["lossless"]["ddtree_b16_bf16_vs_target_fa_bf16"]["batch4"]["only_near_ties"] is True
    # Against TREE_ATTN's target, whose two logits there are five steps apart, it is a real departure.
    assert summary["lossless"]["ddtree_b16_bf16_vs_target_tree_attn_bf16"]["batch4"]["only_near_ties"] is False
