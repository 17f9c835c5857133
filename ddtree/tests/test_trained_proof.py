"""The trained-pair proof's verdicts, on hand-made run files (ddtree/trained/proof.py; no GPU)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from ddtree.trained import proof


def test_run_names():
    assert proof.run_config("ddtree32_fp16_graphs") == {
        "method": "ddtree",
        "budget": 32,
        "dtype": "fp16",
        "graphs": True,
        "sync": False,
        "broken": False,
        "treeattn": False,
        "dist": False,
        "nan": False,
    }
    assert proof.run_config("target_bf16_treeattn")["treeattn"] is True
    assert proof.phases_for("target_bf16_dist") == "distribution"
    assert proof.phases_for("target_bf16_treeattn") == "greedy"
    assert proof.run_config("chain_bf16")["method"] == "dflash"
    assert proof.run_config("target_bf16_sync")["sync"] is True
    with pytest.raises(ValueError, match="unknown part"):
        proof.run_config("ddtree32_bf17")
    assert proof.phases_for("ddtree32_bf16_broken") == "distribution"
    assert proof.phases_for("chain_fp16") == "greedy"


def _text(seed: int, n: int = proof.GEN_TOKENS) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 for i in range(n)]


def _greedy(tokens, steps=None, top2=None):
    return {"tokens": tokens, "steps": steps or [[1] + [4] * 32] * len(tokens), "top2": top2}


def _decisions(ks: dict[int, int], n: int = proof.GEN_TOKENS) -> list[dict]:
    """Per anchor: the reference accepts ks.get(anchor, 0) nodes, with wide margins except at anchor 4."""
    out = []
    for a in range(n - 1):
        k = ks.get(a, 0)
        margin = 0.01 if a == 4 else 3.0
        out.append({"k": k, "inside": [margin] * k, "outside": margin})
    return out


def test_reference_judged_at_the_engines_anchors_until_it_departs():
    y = _text(1)
    # the engine's steps: anchors 0 (accepts 3), 4 (2), 7 (5), 13 (0), 14 (4)
    decisions = _decisions({0: 3, 4: 2, 7: 5, 14: 4})
    reference = {"prompts": [{"continuation": y, "decisions": {"ddtree32": decisions}}]}
    run = {"greedy_batch1": _greedy([y], [[1, 4, 3, 6, 1, 5]])}
    v = proof.judge_reference(reference, run, "ddtree32", "bf16")
    assert (v["steps_compared"], v["steps_equal"], v["mismatches"], v["equal"]) == (5, 5, [], True)
    # another count at anchor 4, where the reference's margin is 0.01: a near-tie of bf16
    run = {"greedy_batch1": _greedy([y], [[1, 4, 2, 6, 1, 5]])}
    v = proof.judge_reference(reference, run, "ddtree32", "bf16")
    assert v["mismatches"][0] == {
        "prompt": 0,
        "step": 1,
        "anchor": 4,
        "engine": 1,
        "reference": 2,
        "margin": 0.01,
        "near_tie": True,
    }
    assert not v["equal"] and v["equal_but_near_ties"] is False  # the later anchors shifted: wide margins
    # a mismatch where the margin is wide is not a near-tie
    run = {"greedy_batch1": _greedy([y], [[1, 5]])}
    v = proof.judge_reference(reference, run, "ddtree32", "bf16")
    assert v["mismatches"] == [
        {"prompt": 0, "step": 0, "anchor": 0, "engine": 4, "reference": 3, "margin": 3.0, "near_tie": False}
    ]
    # the engine departed from the reference's text at token 5: only the steps that end before it count
    departed = [*y[:5], 9999, *y[6:]]
    v = proof.judge_reference(reference, {"greedy_batch1": _greedy([departed], [[1, 4, 3, 6]])}, "ddtree32", "bf16")
    assert v["steps_compared"] == 1 and v["equal"]


def test_summary_judges_identity_real_text_and_distribution(tmp_path):
    ys = [_text(s) for s in range(3)]
    top2 = [[[[t, 10.0], [t + 1, 9.0]] for t in y] for y in ys]
    base = {"config": proof.run_config("target_bf16"), "greedy_batch1": _greedy(ys, top2=top2)}
    good = {"config": proof.run_config("ddtree32_bf16"), "greedy_batch1": _greedy(ys)}
    loop = [[21, 59] * 64, *ys[1:]]
    bad = {
        "config": proof.run_config("chain_bf16"),
        "greedy_batch1": _greedy([[*ys[0][:5], 4001, *ys[0][6:]], *ys[1:]]),
    }
    looping = {"config": proof.run_config("ddtree15_bf16"), "greedy_batch1": _greedy(loop)}
    for name, r in (("target_bf16", base), ("ddtree32_bf16", good), ("chain_bf16", bad), ("ddtree15_bf16", looping)):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    s = proof.summarise("unused", str(tmp_path))
    assert s["identity"]["ddtree32_bf16"]["greedy_batch1"]["identical"] == 3
    chain = s["identity"]["chain_bf16"]["greedy_batch1"]
    assert chain["identical"] == 2 and not chain["only_near_ties"] and chain["departures"][0]["at"] == 5
    assert s["real_text"]["ddtree32_bf16"]["not_real_text"] == []
    looped = s["real_text"]["ddtree15_bf16"]["not_real_text"][0]
    assert looped["why"].startswith("2 distinct tokens") and looped["departed"]
    assert s["acceptance"]["ddtree32_bf16"]["greedy_batch1"]["mean_acceptance_length"] == 4.0


def test_a_mode_run_on_every_fourth_prompt_is_judged_against_the_same_prompts(tmp_path):
    assert proof.mode_run(proof.run_config("ddtree32_bf16_graphs")) and proof.mode_run(
        proof.run_config("ddtree32_bf16_nan")
    )
    assert not proof.mode_run(proof.run_config("ddtree32_fp16"))
    # the first length had 3 prompts chosen, the second none, the third 4
    by_length = [{"chosen_min_gaps": [0.1] * 3}, {"chosen_min_gaps": []}, {"chosen_min_gaps": [0.2] * 4}]
    assert proof.one_per_length({"by_length": by_length}) == [0, 3]
    ys = [_text(s) for s in range(8)]
    top2 = [[[[t, 10.0], [t + 1, 9.0]] for t in y] for y in ys]
    base = {"config": proof.run_config("target_bf16"), "greedy_batch1": _greedy(ys, top2=top2)}
    # prompts 0 and 4; prompt 4's output departs at token 7 where the target's gap is wide
    sub = [ys[0], [*ys[4][:7], 4001, *ys[4][8:]]]
    nan = {"config": proof.run_config("ddtree32_bf16_nan"), "greedy_batch1": _greedy(sub) | {"prompt_ids": [0, 4]}}
    for name, r in (("target_bf16", base), ("ddtree32_bf16_nan", nan)):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    v = proof.summarise("unused", str(tmp_path))["identity"]["ddtree32_bf16_nan"]["greedy_batch1"]
    assert v["compared"] == 2 and v["identical"] == 1
    assert v["departures"][0]["prompt"] == 4 and v["departures"][0]["at"] == 7 and not v["only_near_ties"]


def test_a_looping_output_at_a_batch_the_target_did_not_run_is_a_failure_not_the_targets_loop():
    ys = [_text(s) for s in range(8)]
    target = {"greedy_batch1": _greedy(ys), "greedy_batch4": _greedy(ys[:4]) | {"prompt_ids": [0, 1, 2, 3]}}
    run = {"greedy_batch4": _greedy([ys[0], [21, 59] * 64]) | {"prompt_ids": [0, 4]}}
    v = proof.real_text(run, target)
    assert v["target_not_real_text"] == []
    assert v["not_real_text"] == [
        {"phase": "greedy_batch4", "prompt": 4, "why": v["not_real_text"][0]["why"], "departed": True}
    ]


def test_a_tree_is_sampled_against_the_target_on_its_own_backend_and_the_backends_against_each_other(tmp_path):
    def dist(tokens):  # 2,000 samples of one prefix, 1 token each
        return {"qwen": {"samples": [[[t] for t in tokens]]}}

    even = [i % 4 for i in range(2000)]
    skewed = [0 if i % 2 else i % 4 for i in range(2000)]
    runs = {
        "target_bf16_dist": {"config": proof.run_config("target_bf16_dist"), "distribution": dist(even)},
        "target_bf16_treeattn_dist": {
            "config": proof.run_config("target_bf16_treeattn_dist"),
            "distribution": dist(skewed),
        },
        "ddtree32_bf16_dist": {"config": proof.run_config("ddtree32_bf16_dist"), "distribution": dist(skewed)},
    }
    for name, r in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    d = proof.summarise(str(tmp_path / "no-pair"), str(tmp_path))["distribution"]
    assert d["ddtree32_bf16_dist"]["against"] == "target_bf16_treeattn_dist"
    assert d["ddtree32_bf16_dist"]["qwen"]["min_p"] > 0.5  # the same samples: only the tree could differ
    assert d["target_bf16_treeattn_dist"]["against"] == "target_bf16_dist"
    assert d["target_bf16_treeattn_dist"]["qwen"]["min_p"] < 1e-6  # the backends' control sees the skew
    assert "target_bf16_dist" not in d


STEP = 0.03125  # one bf16 step at logits in [4, 8)


def _top3(ys, at: dict[tuple[int, int], list]) -> list:
    """The target's best logits per token: a wide gap everywhere but at the (prompt, token) given."""
    return [[at.get((i, j), [[t, 6.0], [t + 1, 4.5]]) for j, t in enumerate(y)] for i, y in enumerate(ys)]


def _batch_shape_pair(tmp_path, departs: dict[int, int], batch1: bool = True) -> dict:
    """The target alone at batch 1 and 8 and DDTree at batch 8, departing (to the target's second best)
    at {prompt: token}. At prompt 0, token 5 the target's two best tie at batch 1 and are 2 steps apart
    at batch 8 (its batch shape moves that gap by 2 steps); at prompt 1, token 7 they are 3 steps
    apart at both."""
    ys = [_text(s) for s in range(3)]
    eight = _top3(ys, {(0, 5): [[ys[0][5], 5.0 + 2 * STEP], [ys[0][5] + 1, 5.0]]})
    eight[1][7] = [[ys[1][7], 5.0 + 3 * STEP], [ys[1][7] + 1, 5.0]]
    one = _top3(ys, {(0, 5): [[ys[0][5], 5.0], [ys[0][5] + 1, 5.0]]})
    one[1][7] = eight[1][7]
    target = {"config": proof.run_config("target_bf16"), "greedy_batch8": _greedy(ys, top2=eight)}
    if batch1:
        target["greedy_batch1"] = _greedy(ys, top2=one)
    else:  # batch 8 alone: no batch shape to compare, judged from batch 8's own logits
        target["greedy_batch1"] = _greedy(ys, top2=eight)
    outs = [
        [*y[: departs[i]], y[departs[i]] + 1, *y[departs[i] + 1 :]] if i in departs else y for i, y in enumerate(ys)
    ]
    run = {"config": proof.run_config("ddtree32_bf16"), "greedy_batch1": _greedy(ys), "greedy_batch8": _greedy(outs)}
    for name, r in (("target_bf16", target), ("ddtree32_bf16", run)):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    return proof.summarise("unused", str(tmp_path))


def test_a_departure_within_the_targets_own_batch_shape_movement_is_a_near_tie(tmp_path):
    s = _batch_shape_pair(tmp_path, {0: 5})
    noise = s["near_tie_noise"]["bf16"]
    assert noise["bound_steps"] == 2.0 and noise["set_by"] == "batch" and noise["backends"] is None
    assert noise["batch"] == {
        "runs": "target_bf16",
        "phases": "greedy_batch1 / greedy_batch8",
        "prompt": 0,
        "at": 5,
        "movement": 2 * STEP,
        "steps": 2.0,
    }
    d = s["identity"]["ddtree32_bf16"]["greedy_batch8"]["departures"]
    assert [(x["prompt"], x["at"], x["gap_in_dtype_steps"], x["near_tie"]) for x in d] == [(0, 5, 2.0, True)]
    # The same departure where the target ran no other batch shape: nothing measured moves a gap 2 steps.
    d = _batch_shape_pair(tmp_path, {0: 5}, batch1=False)["identity"]["ddtree32_bf16"]["greedy_batch8"]
    assert d["departures"][0]["near_tie"] is False and not d["only_near_ties"]


def test_a_departure_wider_than_every_measured_movement_still_fails(tmp_path):
    s = _batch_shape_pair(tmp_path, {1: 7})
    assert s["near_tie_noise"]["bf16"]["bound_steps"] == 2.0
    v = s["identity"]["ddtree32_bf16"]["greedy_batch8"]
    assert [(x["prompt"], x["gap_in_dtype_steps"], x["near_tie"]) for x in v["departures"]] == [(1, 3.0, False)]
    assert not v["only_near_ties"]


def test_the_backends_movement_counts_and_a_sampled_twin_does_not_erase_it(tmp_path):
    ys = [_text(s) for s in range(2)]
    fa = {"config": proof.run_config("target_bf16"), "greedy_batch1": _greedy(ys, top2=_top3(ys, {}))}
    moved = _top3(ys, {(1, 9): [[ys[1][9], 6.0 + 3 * STEP], [ys[1][9] + 1, 4.5]]})
    runs = {
        "target_bf16": fa,
        "target_bf16_treeattn": {
            "config": proof.run_config("target_bf16_treeattn"),
            "greedy_batch1": _greedy(ys, top2=moved),
        },
        # the sampled run on TREE_ATTN records no logits: it says nothing of the backends' movement
        "target_bf16_treeattn_dist": {"config": proof.run_config("target_bf16_treeattn_dist"), "distribution": {}},
    }
    for name, r in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    s = proof.summarise("unused", str(tmp_path))
    assert s["kernel_noise"] == {"bf16": 3 * STEP}
    noise = s["near_tie_noise"]["bf16"]
    assert (noise["bound_steps"], noise["set_by"], noise["batch"]) == (3.0, "backends", None)
    assert noise["backends"]["runs"] == "target_bf16 / target_bf16_treeattn"


def test_a_near_tie_prefix_is_left_out_of_the_sampled_verdict_but_a_broken_walk_still_fails(tmp_path, monkeypatch):
    import math
    import random

    r = random.Random(5)
    ps = [0.6, 0.3, 0.0482, 0.03, 0.0218]  # prefix 0: token 3 is kept 0.0018 inside the top-p cut

    def draw(weights, n=2000, first=None):
        return [[r.choices(range(5), first or weights)[0], *r.choices(range(5), weights, k=3)] for _ in range(n)]

    without_3 = [0.6, 0.3, 0.0482, 0.0, 0.0218]  # the run's prefill rounds token 3 out of the kept set
    target = [draw(ps) for _ in range(4)]
    good = [draw(ps, first=without_3), *(draw(ps) for _ in range(3))]
    # the drafter's first child taken as the target's choice: token 0 at every later position
    broken = [[[s[0], 0, 0, 0] for s in draw(ps, first=without_3 if k == 0 else None)] for k in range(4)]
    runs = {"target_bf16_dist": target, "ddtree32_bf16_dist": good, "ddtree32_bf16_broken": broken}
    for name, samples in runs.items():
        cfg = proof.run_config(name)
        (tmp_path / f"{name}.json").write_text(
            json.dumps({"config": cfg, "distribution": {"qwen": {"samples": samples}}})
        )
    (tmp_path / "pair" / "target").mkdir(parents=True)
    near = [9.5 + 0.7 * math.log(q / ps[0]) for q in ps]  # one bf16 step on the top logit drops token 3
    far = [9.5 + 0.7 * math.log(q / 0.5) for q in (0.5, 0.3, 0.1, 0.08, 0.02)]
    monkeypatch.setattr(proof, "prefix_logits", lambda pair: [near, far, far, far])
    s = proof.summarise(str(tmp_path / "pair"), str(tmp_path))
    assert [x["prefix"] for x in s["sampled_prefix_near_ties"]["bf16"]["qwen"]] == [0]
    good_v = s["distribution"]["ddtree32_bf16_dist"]["qwen"]
    assert good_v["min_p"] < 1e-6  # the raw test over every prefix is kept: it fails on prefix 0
    assert good_v["judged"]["prefixes"] == [1, 2, 3] and good_v["judged"]["min_p"] > proof.PASS_P
    assert good_v["excluded_p_by_prefix"]["0"][0] < 1e-6 and good_v["passes"] is True
    broken_v = s["distribution"]["ddtree32_bf16_broken"]["qwen"]
    assert broken_v["judged"]["prefixes"] == [1, 2, 3] and broken_v["judged"]["min_p"] < 1e-100
    assert broken_v["passes"] is False


class _Engine:
    """vLLM's engine as ``stepwise`` drives it: each step gives every request in flight one token
    (request ``i`` finishes after ``lengths[i]``), and it records which requests ran in each step."""

    def __init__(self, lengths: list[int]):
        self.lengths, self.live, self.steps = lengths, {}, []

    def add_request(self, rid, prompt, params):
        self.live[rid] = [int(rid.split("-")[1]), 0]

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        from types import SimpleNamespace

        self.steps.append(sorted(i for i, _ in self.live.values()))
        outs = []
        for rid, state in list(self.live.items()):
            state[1] += 1
            done = state[1] >= self.lengths[state[0]]
            token = SimpleNamespace(token_ids=[100 + state[0]], logprobs=None)
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[token]))
            if done:
                del self.live[rid]
        return outs


@pytest.mark.parametrize("continuous", [False, True])
def test_mixed_phase_adds_a_prompt_as_one_finishes_and_groups_start_together(monkeypatch, continuous):
    import sys
    import types
    from types import SimpleNamespace

    vllm = types.ModuleType("vllm")
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = SimpleNamespace(DELTA="delta")
    for name, mod in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.sampling_params", sampling)):
        monkeypatch.setitem(sys.modules, name, mod)
    engine = _Engine([3, 1, 2, 2])
    params = SimpleNamespace(clone=lambda: SimpleNamespace())
    out = proof.stepwise(SimpleNamespace(llm_engine=engine), [[1]] * 4, params, 2, continuous=continuous)
    assert out["tokens"] == [[100] * 3, [101], [102] * 2, [103] * 2]  # in prompt order, whatever the schedule
    if continuous:
        # prompt 2 joins the step after prompt 1 finishes, beside prompt 0 still running
        assert engine.steps == [[0, 1], [0, 2], [0, 2], [3], [3]]
    else:
        assert engine.steps == [[0, 1], [0], [0], [2, 3], [2, 3]]


def _fake_walk_module(monkeypatch):
    """``vllm.v1.spec_decode.ddtree`` as the broken walk patches it: ``walk_trees`` returns what it was given."""
    import sys
    import types

    mod = types.ModuleType("vllm.v1.spec_decode.ddtree")
    mod.walk_trees = lambda tree, target_tokens: target_tokens
    pkg = types.ModuleType("vllm.v1.spec_decode")
    pkg.ddtree = mod
    for name, m in (("vllm", types.ModuleType("vllm")), ("vllm.v1", types.ModuleType("vllm.v1"))):
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setitem(sys.modules, "vllm.v1.spec_decode", pkg)
    monkeypatch.setitem(sys.modules, "vllm.v1.spec_decode.ddtree", mod)
    return mod


def test_the_broken_walk_counts_the_choices_it_forces(monkeypatch):
    import torch

    mod = _fake_walk_module(monkeypatch)
    counts = proof.break_walk()
    # one request, root + 3 nodes: node 0 (token 7) and node 1 (token 8) are children of the root, node 2
    # (token 9) of node 0; the target chose 7 at the root and 5 at node 0
    tree = _tree(tokens=[[7, 8, 9]], parent=[[-1, -1, 0]])
    got = mod.walk_trees(tree, torch.tensor([[7, 5, 0, 0]]))
    assert got.tolist() == [[7, 9, 0, 0]]  # the root's first child (7) and node 0's first child (9)
    assert counts == {"walks": 1, "forced_nodes": 1}
    assert proof.sabotage_engaged({"sabotage": counts}) is True
    assert proof.sabotage_engaged({"sabotage": {"walks": 4, "forced_nodes": 0}}) is False
    assert proof.sabotage_engaged({}) is None


def _tree(tokens, parent):
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(tokens=torch.tensor(tokens), parent=torch.tensor(parent))


def test_a_broken_run_whose_walk_never_ran_is_reported_as_not_engaged(tmp_path):
    samples = [[[1, 2, 3, 4]] * 50 for _ in range(4)]
    for name, extra in (
        ("target_bf16_dist", {}),
        ("ddtree32_bf16_broken", {"sabotage": {"walks": 0, "forced_nodes": 0}}),
        ("ddtree32_bf16_nan", {"sabotage": {"drafter_passes": 30, "poisoned": 10}}),
    ):
        (tmp_path / f"{name}.json").write_text(
            json.dumps({"config": proof.run_config(name), "distribution": {"qwen": {"samples": samples}}} | extra)
        )
    s = proof.summarise(str(tmp_path / "no-pair"), str(tmp_path))
    assert s["sabotage"]["ddtree32_bf16_broken"]["engaged"] is False
    assert s["sabotage"]["ddtree32_bf16_nan"] == {"counts": {"drafter_passes": 30, "poisoned": 10}, "engaged": True}


def test_an_engine_run_keeps_the_engine_core_in_its_own_process(tmp_path, monkeypatch):
    """The sabotage patches this process's modules: a spawned engine core would run unpatched."""
    import os
    import sys
    import types

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    seen = {}

    class Started(Exception):
        pass

    def start(**kwargs):
        seen["mp"] = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        raise Started

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = start, object
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(proof, "engine_kwargs", lambda pair, cfg: {})
    (tmp_path / "prompts.json").write_text(json.dumps({"prompts": [[1]]}))
    with pytest.raises(Started):
        proof.cmd_gen(types.SimpleNamespace(name="target_bf16", pair=str(tmp_path), result="x", phases="greedy"))
    assert seen["mp"] == "0"


def _build(kind="hybrid", **sha):
    return {
        "kind": kind,
        "target": {"stopped_early": False},
        "drafter": {"stopped_early": False},
        "on_policy_text": {"stopped_early": False},
        "sha256": {"target/model.safetensors": "a1", "drafter/model.safetensors": "b2", **sha},
    }


def test_a_second_build_repeats_only_with_every_file_equal_and_nothing_cut():
    assert proof.repeat_build(_build(), _build()) == {
        "sha256_equal": True,
        "differing": [],
        "cut_by_deadline": [],
        "repeats": True,
    }
    other = proof.repeat_build(_build(), _build(**{"drafter/model.safetensors": "ff"}))
    assert other["differing"] == ["drafter/model.safetensors"] and other["repeats"] is False
    missing = _build()
    del missing["sha256"]["target/model.safetensors"]
    assert proof.repeat_build(_build(), missing)["differing"] == ["target/model.safetensors"]
    cut = _build()
    cut["target"]["stopped_early"] = True
    got = proof.repeat_build(_build(), cut)
    assert got["sha256_equal"] is True and got["cut_by_deadline"] == ["target"] and got["repeats"] is False
    with pytest.raises(ValueError, match="not builds of one pair"):
        proof.repeat_build(_build(), _build(kind="attention"))
    with pytest.raises(ValueError, match="sha256"):
        proof.repeat_build(_build(), {"kind": "hybrid"})
