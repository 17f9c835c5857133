"""The trained pairs' drafter, tree and statistics on the CPU (ddtree/trained)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from ddtree.trained import models  # noqa: E402
from ddtree.trained.realtext import degenerate, shortest_loop  # noqa: E402
from ddtree.trained.reference import Node, build_tree, chain, decide, walk  # noqa: E402
from ddtree.trained.stats import acceptance, chi2_sf, homogeneity  # noqa: E402

SMALL = models.DrafterShape(
    hidden=32, target_hidden=24, taps=2, window=5, heads=4, kv_heads=2, head_dim=8, intermediate=48
)


def _drafter(shape=SMALL) -> models.Drafter:
    torch.manual_seed(0)
    d = models.Drafter(shape).eval()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms away from 1, so a wrong mask shows
    return d


def test_block_mask_full_and_sliding_literal():
    # one block anchored at 3 of a 4-token context: context keys 0..2; the block's 16 keys
    full = models.block_mask(torch.tensor([[3]]), 4, None)[0]
    assert full[:, :4].tolist() == [[True, True, True, False]] * models.BLOCK
    assert full[:, 4:].all()
    sliding = models.block_mask(torch.tensor([[3]]), 4, 2)[0]
    # query j sits at position 3 + j; a window of 2 sees itself and the position before
    assert sliding[0, :4].tolist() == [False, False, True, False]
    assert sliding[1, :4].tolist() == [False, False, False, False]
    assert sliding[1, 4:7].tolist() == [True, True, False]
    assert sliding[5, 4:].nonzero().flatten().tolist() == [4, 5]


def test_training_blocks_equal_one_block_at_a_time():
    """Several blocks of one sequence in one pass (training) give what each block gives alone over
    its own context only (inference, as vLLM runs it), in full and in sliding layers."""
    d = _drafter()
    torch.manual_seed(1)
    T = 40
    taps = torch.randn(1, T, SMALL.taps * SMALL.target_hidden)
    anchors = torch.tensor([[7, 20, 33]])
    embeds = torch.randn(1, 3 * models.BLOCK, SMALL.hidden)
    together = d(taps, anchors, embeds)[0].view(3, models.BLOCK, -1)
    for m, a in enumerate(anchors[0].tolist()):
        alone = d(taps[:, :a], torch.tensor([[a]]), embeds[:, m * models.BLOCK : (m + 1) * models.BLOCK])[0]
        torch.testing.assert_close(together[m], alone, rtol=1e-4, atol=1e-5)


def test_context_past_the_anchor_is_never_seen():
    d = _drafter()
    torch.manual_seed(2)
    taps = torch.randn(1, 30, SMALL.taps * SMALL.target_hidden)
    embeds = torch.randn(1, models.BLOCK, SMALL.hidden)
    a = d(taps, torch.tensor([[12]]), embeds)
    changed = taps.clone()
    changed[:, 12:] += 5.0
    torch.testing.assert_close(d(changed, torch.tensor([[12]]), embeds), a)
    changed[:, 11] += 5.0  # the last context position is seen
    assert not torch.allclose(d(changed, torch.tensor([[12]]), embeds), a)


def test_sliding_layers_see_only_their_window():
    shape = models.DrafterShape(
        hidden=32,
        target_hidden=24,
        taps=2,
        layer_types=("sliding_attention",),
        window=4,
        heads=4,
        kv_heads=2,
        head_dim=8,
        intermediate=48,
    )
    d = _drafter(shape)
    torch.manual_seed(3)
    taps = torch.randn(1, 30, 48)
    embeds = torch.randn(1, models.BLOCK, 32)
    base = d(taps, torch.tensor([[20]]), embeds)
    far = taps.clone()
    far[:, :17] += 5.0  # positions 0..16: outside the window of the block's first query (20 - 4 + 1 = 17)
    torch.testing.assert_close(d(far, torch.tensor([[20]]), embeds), base)
    near = taps.clone()
    near[:, 17] += 5.0
    out = d(near, torch.tensor([[20]]), embeds)
    assert not torch.allclose(out[0, 0], base[0, 0])  # the first query sees position 17
    torch.testing.assert_close(out[0, 1:], base[0, 1:])  # later queries' windows start after it


def test_drafter_tensor_names_are_the_published_layout():
    names = set(_drafter().state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_layer_ids_come_from_drafter_config_rule():
    assert models.drafter_layer_ids(8, 3) == [1, 3, 5]
    assert models.drafter_layer_ids(64, 5) == [1, 16, 31, 46, 61]


def _brute_force(logits: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """The ``budget`` most probable prefixes by enumeration (tiny vocabularies only)."""
    logp = logits.log_softmax(-1)
    scored = []
    depth, vocab = logp.shape
    frontier = [((), 0.0)]
    for d in range(depth):
        frontier = [((*p, t), s + float(logp[d, t])) for p, s in frontier for t in range(vocab)]
        scored += frontier
    scored.sort(key=lambda x: -x[1])
    return {p for p, _ in scored[:budget]}


def _paths(nodes: list[Node]) -> set[tuple[int, ...]]:
    out = set()
    for i in range(len(nodes)):
        path, j = [], i
        while j >= 0:
            path.append(nodes[j].token)
            j = nodes[j].parent
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_heap_tree_is_the_most_probable_prefixes(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 4, generator=g) * 2
    for budget in (1, 5, 12):
        nodes = build_tree(logits, budget)
        assert len(nodes) == budget
        assert all(n.parent < i for i, n in enumerate(nodes))  # parents first
        assert _paths(nodes) == _brute_force(logits, budget)


def test_heap_tree_matches_the_engines_tree_definition():
    """The reference's heap and the change set's batched build keep the same prefixes."""
    import importlib.util
    import sys

    from ddtree import HOME

    path = HOME / "common/ddtree_tree.py"
    spec = importlib.util.spec_from_file_location("ddtree_tree_for_reference_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    g = torch.Generator().manual_seed(7)
    for budget in (15, 32, 64):
        logits = torch.randn(2, 15, 300, generator=g) * 3
        tree = mod.build_trees(logits, budget, kernels=False)
        for r in range(2):
            nodes = [Node(int(tree.tokens[r, j]), int(tree.depth[r, j]), int(tree.parent[r, j])) for j in range(budget)]
            assert _paths(nodes) == _paths(build_tree(logits[r], budget))


def test_walk_follows_the_targets_choices():
    nodes = [Node(5, 1, -1), Node(6, 1, -1), Node(7, 2, 1), Node(8, 3, 2)]
    choices = {-1: 6, 1: 7, 2: 9}
    assert walk(nodes, lambda at: choices.get(at, -2)) == 2
    assert walk(nodes, lambda at: 4) == 0
    assert [n.token for n in chain(torch.tensor([[0.0, 3.0], [2.0, 1.0]]))] == [1, 0]


def test_decide_gives_the_walk_and_its_margins():
    # depth 1 prefers token 2 (logit 3) over 1 (2.5); depth 2 prefers 0
    logits = torch.tensor([[0.0, 2.5, 3.0, -9.0], [4.0, 1.0, 0.0, -9.0]])
    chain_pick = decide(logits, [2, 0, 7], None)
    assert chain_pick["k"] == 2 and chain_pick["outside"] is None
    assert chain_pick["inside"] == [pytest.approx(0.5, abs=1e-4), pytest.approx(3.0, abs=1e-4)]
    miss = decide(logits, [1, 0], None)
    assert miss["k"] == 0 and miss["outside"] == pytest.approx(0.5, abs=1e-4)
    tree = decide(logits, [1, 0], 3)  # budget 3: 2, then 2 -> 0, then 1 (1 -> 0 is the best left out)
    assert tree["k"] == 1
    logp = logits.log_softmax(-1)
    # the path's depth-2 node (1 -> 0) was left out by the margin to the worst kept node (1)
    assert tree["outside"] == pytest.approx(float(logp[0, 1] - (logp[0, 1] + logp[1, 0])), abs=1e-4)


def test_degenerate_outputs_are_named():
    assert degenerate([21, 59] * 64).startswith("2 distinct tokens")
    assert degenerate(list(range(40)) + [1, 2, 3] * 30) == "loops with period 3 over 32 tokens"
    assert degenerate(list(range(128))) is None
    assert shortest_loop([5] * 31 + [1]) is None
    assert shortest_loop([5] * 32) == 1


def test_acceptance_from_steps():
    a = acceptance([[1, 3, 4, 2], [1, 1, 5]], 128, 3)
    # last step of each request left out: steps 3, 4 and 1
    assert a["steps"] == 3
    assert a["mean_acceptance_length"] == round(8 / 3, 4)
    assert a["accepted_at_depth"] == [round(2 / 3, 4), round(2 / 3, 4), round(1 / 3, 4)]


def test_chi_square_tail():
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf(0.0, 3) == pytest.approx(1.0)


def test_homogeneity_passes_the_same_and_fails_another_distribution():
    r = random.Random(0)

    def draw(ps, n):
        return [[r.choices(range(len(ps)), ps)[0] for _ in range(4)] for _ in range(n)]

    same = homogeneity([draw([0.5, 0.3, 0.2], 2000) for _ in range(3)], [draw([0.5, 0.3, 0.2], 2000) for _ in range(3)])
    other = homogeneity(
        [draw([0.5, 0.3, 0.2], 2000) for _ in range(3)], [draw([0.4, 0.4, 0.2], 2000) for _ in range(3)]
    )
    assert same["min_p"] > 0.01
    assert other["min_p"] < 1e-6
    assert [x["position"] for x in other["by_position"]] == [1, 2, 3, 4]


def test_homogeneity_names_the_prefix_a_failure_comes_from():
    r = random.Random(1)

    def draw(ps, n):
        return [[r.choices(range(len(ps)), ps)[0] for _ in range(2)] for _ in range(n)]

    same = [0.5, 0.3, 0.2]
    a = [draw(same, 2000) for _ in range(3)]
    b = [draw(same, 2000), draw([0.4, 0.4, 0.2], 2000), draw(same, 2000)]  # only the second prefix differs
    h = homogeneity(a, b)
    assert h["min_p"] < 1e-6
    assert len(h["p_by_prefix"]) == 3 and all(len(p) == 2 for p in h["p_by_prefix"])
    assert max(h["p_by_prefix"][1]) < 1e-6
    assert min(h["p_by_prefix"][0] + h["p_by_prefix"][2]) > 0.001


def test_plan_runs_its_fixed_steps_and_stops_at_the_deadline(monkeypatch):
    from ddtree.trained import build

    now = [1000.0]
    monkeypatch.setattr(build.time, "time", lambda: now[0])
    fixed = build.Plan(40, deadline=1e12)
    assert fixed.stop(40) and not fixed.stop(39)
    late = build.Plan(40, deadline=1000.0 + 10.0)
    step = 0
    while not late.stop(step):
        now[0] += 0.5
        step += 1
    assert step == 21  # past the deadline, not the count


def test_file_digests_name_every_file_but_the_timings(tmp_path):
    import hashlib

    from ddtree.trained import build

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "prompts.json").write_text("[]")
    (tmp_path / "build.json").write_text("{}")
    assert build.file_digests(str(tmp_path)) == {
        "prompts.json": hashlib.sha256(b"[]").hexdigest(),
        "target/model.safetensors": hashlib.sha256(b"weights").hexdigest(),
    }


def test_prompts_are_drawn_again_where_a_length_has_too_few_real_text_candidates(monkeypatch):
    import torch

    from ddtree.trained import build

    monkeypatch.setattr(build, "PROMPT_LENGTHS", [16])
    monkeypatch.setattr(build, "load_stream", lambda root, name, dev: torch.arange(5000) % 4000)
    rounds = []

    def greedy(lm, cands, steps):
        rounds.append(len(cands))
        # two real-text candidates in the first draw (a loop elsewhere), four in the next
        real = 2 if len(rounds) == 1 else 4
        toks = [list(range(100, 100 + steps)) if i < real else [1, 2] * (steps // 2) for i in range(len(cands))]
        return toks, [[float(i + 1)] * steps for i in range(len(cands))]

    monkeypatch.setattr(build, "greedy_with_gaps", greedy)

    class LM:
        def float(self):
            return self

    got = build.choose_prompts(LM(), "root", torch.device("cpu"))
    assert rounds == [build.CANDIDATES_PER_LENGTH] * 2
    assert len(got["prompts"]) == build.PROMPTS_PER_LENGTH
    assert got["by_length"][0]["real_text_candidates"] == 6


def test_kept_tokens_follow_vllms_top_k_and_top_p_and_say_how_close_the_cut_is():
    import math

    from ddtree.trained.stats import kept_tokens

    logp = [math.log(q) for q in (0.6, 0.3, 0.06, 0.04)]
    # before each token: 0, 0.6, 0.9, 0.96; top_p 0.95 keeps the first three (0.9 < 0.95)
    kept, margin = kept_tokens(logp, 1.0, 0, 0.95)
    assert kept == {0, 1, 2} and abs(margin - 0.01) < 1e-9
    assert kept_tokens(logp, 1.0, 2, 0.95)[0] == {0, 1}  # top-k first: 0.667 + 0.333
    assert kept_tokens(logp, 1.0, 0, 0.5)[0] == {0}
    assert kept_tokens(logp, 1.0, 0, 1.0) == ({0, 1, 2, 3}, math.inf)


def _logits(ps, temperature=0.7, top=9.5):
    """Logits whose sampler probabilities at ``temperature`` are ``ps``, the largest at ``top``."""
    import math

    return [top + temperature * math.log(q / ps[0]) for q in ps]


# Tokens 0-2 hold 0.9482 (the attention pair's prefix 0): token 3 is kept, 0.0018 inside the cut.
NEAR_CUT = [0.6, 0.3, 0.0482, 0.03, 0.0218]
FAR_CUT = [0.5, 0.3, 0.1, 0.08, 0.02]  # the cut 0.03 and 0.05 from the sums either side


def test_a_prefix_whose_kept_set_one_rounding_step_changes_is_a_near_tie():
    from ddtree.gpu.pair_proof import dtype_step
    from ddtree.trained.stats import kept_tokens, near_tie_prefix

    def bf16(x):
        return dtype_step(x, "bfloat16")

    assert kept_tokens(_logits(NEAR_CUT), 0.7, 20, 0.95)[0] == {0, 1, 2, 3}
    near = near_tie_prefix(_logits(NEAR_CUT), 0.7, 20, 0.95, bf16)
    # one bf16 step up on the top logit (9.5 -> 9.5625) drops token 3
    assert near == {"token": 0, "shift": 0.0625, "kept": [0, 1, 2, 3], "kept_moved": [0, 1, 2]}
    assert near_tie_prefix(_logits(FAR_CUT), 0.7, 20, 0.95, bf16) is None
    # the far cut is within reach of a move wider than rounding: the move is what is tested
    assert near_tie_prefix(_logits(FAR_CUT), 0.7, 20, 0.95, lambda x: 1.0) is not None
    assert near_tie_prefix(_logits(NEAR_CUT), 1.0, 0, 1.0, bf16) is None  # no top-k or top-p: no cut


def test_homogeneity_leaves_an_excluded_prefix_out_of_the_sums_exactly():
    r = random.Random(2)

    def draw(ps, n):
        return [[r.choices(range(len(ps)), ps)[0] for _ in range(3)] for _ in range(n)]

    a = [draw([0.5, 0.3, 0.2], 500) for _ in range(3)]
    b = [draw([0.5, 0.3, 0.2], 500), draw([0.2, 0.2, 0.6], 500), draw([0.5, 0.3, 0.2], 500)]
    full, without = homogeneity(a, b), homogeneity(a, b, [1])
    alone = homogeneity([a[0], a[2]], [b[0], b[2]])
    assert without["by_position"] == alone["by_position"] and without["min_p"] == alone["min_p"]
    assert without["p_by_prefix"] == full["p_by_prefix"]  # the excluded prefix's own p is still there
    assert without["excluded"] == [1] and full["excluded"] == []
    assert full["min_p"] < 1e-6 < without["min_p"]


def test_a_deterministic_build_attends_through_the_math_backend_only():
    """The fused attention backwards accumulate in a nondeterministic order; the build must not use them."""
    import torch

    from ddtree.trained import build

    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        build.deterministic()
        assert not cuda.cudnn_sdp_enabled() and not cuda.flash_sdp_enabled() and not cuda.mem_efficient_sdp_enabled()
        assert cuda.math_sdp_enabled() and torch.are_deterministic_algorithms_enabled()
    finally:
        cuda.enable_cudnn_sdp(before[0])
        cuda.enable_flash_sdp(before[1])
        cuda.enable_mem_efficient_sdp(before[2])
        torch.use_deterministic_algorithms(was_deterministic)
