"""The DDTree runtime the change set adds to vLLM 0.20.1 (vllm/v1/spec_decode/ddtree.py), on the CPU.

The runtime's logic runs on torch alone: trees kept per request between steps, depth-based
positions and per-request attention bias for verification, the walk and its output layout, and
the compaction of the accepted path. vLLM itself is replaced by ddtree/tests/vllm_modules.py.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import pytest
import torch

# Two trees of 4 nodes, depth 2, vocabulary 8 (the drafter's logits decide them):
#   request "a": tokens [0, 0, 1, 0], parents [-1, 0, -1, 2], depths [1, 2, 1, 2]
#   request "b": tokens [2, 3, 1, 3], same shape.
DRAFT_LOGITS = torch.tensor(
    [
        [[5.0, 4.0, 0, 0, 0, 0, 0, 0], [5.0, 0, 0, 0, 0, 0, 0, 0]],
        [[0, 3.0, 6.0, 0, 0, 0, 0, 0], [0, 0, 0, 6.0, 0, 0, 0, 0]],
    ]
)


@dataclass
class Sampling:
    all_greedy: bool = True
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    generators: dict = field(default_factory=dict)
    max_num_logprobs: int | None = None
    no_penalties: bool = True
    bad_words_token_ids: dict = field(default_factory=dict)
    allowed_token_ids_mask: torch.Tensor | None = None


def one_hot_rows(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        out[i, t] = 10.0
    return out


class Step:
    """One verification step of the batch [b (tree), c (prefill, no drafts), a (tree)]."""

    def __init__(self, dd, drafts_a: int = 4):
        self.rt = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
        self.tokens = self.rt.build(DRAFT_LOGITS, ["a", "b"]).tolist()
        self.num_draft = [4, 0, drafts_a]
        qlens = [5, 3, drafts_a + 1]
        self.qsl = torch.tensor([0, 5, 8, 8 + drafts_a + 1])
        self.num_computed = torch.tensor([10, 0, 20], dtype=torch.int32)
        self.req_indices = torch.repeat_interleave(torch.arange(3), torch.tensor(qlens))
        self.query_pos = torch.cat([torch.arange(q) for q in qlens])
        self.positions = self.num_computed[self.req_indices].long() + self.query_pos
        self.seq_positions = self.positions.clone()
        self.input_ids = torch.tensor([7, *self.tokens[1], 4, 5, 6, 9, *self.tokens[0][:drafts_a]])

    def prepare(self, req_ids=("b", "c", "a"), **kw):
        self.rt.prepare_step(
            list(req_ids),
            self.num_draft,
            self.qsl,
            self.num_computed,
            self.req_indices,
            self.query_pos,
            self.positions,
            **kw,
        )


def test_trees_are_built_from_the_drafter_logits(dd):
    step = Step(dd)
    assert step.tokens == [[0, 0, 1, 0], [2, 3, 1, 3]]
    assert step.rt._stored.parent.tolist() == [[-1, 0, -1, 2], [-1, 0, -1, 2]]
    assert step.rt._stored.depth.tolist() == [[1, 2, 1, 2], [1, 2, 1, 2]]


def test_positions_are_root_plus_depth_and_the_bias_is_per_request(dd):
    step = Step(dd)
    step.prepare()
    assert step.positions.tolist() == [10, 11, 12, 11, 12, 0, 1, 2, 20, 21, 22, 21, 22]
    allowed = (dd.current_attn_bias() == 0).int().tolist()
    tree = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]]
    assert allowed[0] == tree  # b: ancestors only
    assert allowed[1] == [[1] * 5] * 5  # c: no drafts, left to the causal mask
    assert allowed[2] == tree  # a
    assert torch.isneginf(dd.current_attn_bias()[0, 2, 3])
    # One persistent buffer (a CUDA graph keeps its address): rows past the batch allow all.
    assert dd.current_attn_bias() is step.rt.attn_bias
    assert dd.current_attn_bias().shape == (4, 5, 5)
    assert (dd.current_attn_bias()[3] == 0).all()
    # A forward without drafts follows: every row goes back to all-allowed.
    step.rt.end_forward()
    assert (dd.current_attn_bias() == 0).all()


def test_a_smaller_batch_clears_the_rows_of_the_larger_one_before_it(dd):
    step = Step(dd)
    step.prepare()
    step.rt.prepare_step(
        ["b"], [4], step.qsl[:2], step.num_computed[:1], step.req_indices[:5], step.query_pos[:5], step.positions
    )
    bias = dd.current_attn_bias()
    assert torch.isneginf(bias[0, 2, 3])
    assert (bias[1:] == 0).all()


def test_a_step_larger_than_the_buffers_is_refused(dd):
    step = Step(dd)
    step.rt.tree_parents = step.rt.tree_parents[:8]
    with pytest.raises(RuntimeError, match="exceeds the buffers sized for 4 / 8"):
        step.prepare()


def test_walk_returns_accepted_path_and_bonus_in_the_rejection_sampler_layout(dd):
    step = Step(dd)
    step.prepare()
    # b: root->1 (node 2), node 2->3 (node 3), node 3->5: accept [1, 3], bonus 5.
    # c: its one row chooses 6.  a: root->0 (node 0), node 0->2 (no such child): accept [0], bonus 2.
    choices = [*[1, 0, 0, 3, 5], 6, *[0, 2, 0, 0, 0]]  # b, c, a
    out = step.rt.sample(one_hot_rows(choices), step.input_ids, step.num_draft, Sampling())
    assert out.sampled_token_ids.tolist() == [[1, 3, 5, -1, -1], [6, -1, -1, -1, -1], [0, 2, -1, -1, -1]]


def test_compaction_moves_the_accepted_path_onto_consecutive_slots(dd):
    step = Step(dd)
    step.prepare()
    choices = [*[1, 0, 0, 3, 5], 6, *[0, 2, 0, 0, 0]]  # b, c, a
    step.rt.sample(one_hot_rows(choices), step.input_ids, step.num_draft, Sampling())
    slots = 100 + 3 * torch.arange(13)  # a block table that is not the identity
    cache = torch.zeros(2, 60, 4, 1, 2)
    for row, slot in enumerate(slots.tolist()):
        cache[:, slot // 4, slot % 4] = float(row)
    hidden = torch.arange(13, dtype=torch.float32).view(-1, 1).repeat(1, 3)
    ids = step.input_ids.clone()
    step.rt.compact([(slots, [cache])], [hidden, ids], step.positions)
    kv_rows = [int(cache[0, s // 4, s % 4, 0, 0]) for s in slots.tolist()]
    # b's nodes 2 and 3 (rows 3, 4) now sit at depths 1 and 2 (rows 1, 2); a's node 0 was in place.
    assert kv_rows == [0, 3, 4, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert hidden[:, 0].tolist() == [0, 3, 4, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert ids.tolist()[:3] == [7, 1, 3]
    assert step.positions.tolist() == step.seq_positions.tolist()


def test_truncated_drafts_only_use_the_scheduled_nodes(dd):
    step = Step(dd, drafts_a=2)  # a's last two nodes were not scheduled
    step.prepare()
    # a: root->1 would match node 2, but node 2 was not verified: nothing accepted, bonus 1.
    choices = [*[1, 0, 0, 3, 5], 6, *[1, 0, 0]]  # b, c, a
    out = step.rt.sample(one_hot_rows(choices), step.input_ids, step.num_draft, Sampling())
    assert out.sampled_token_ids.tolist()[2] == [1, -1, -1, -1, -1]


def test_drafts_without_a_stored_tree_accept_nothing(dd):
    step = Step(dd)
    step.rt.forget_trees()  # drafting was skipped: the scheduler got zeros
    step.prepare()
    assert step.positions.tolist() == [10, 11, 11, 11, 11, 0, 1, 2, 20, 21, 21, 21, 21]
    choices = [*[2, 3, 1, 3, 5], 6, *[0, 0, 1, 0, 0]]  # b, c, a
    out = step.rt.sample(one_hot_rows(choices), step.input_ids, step.num_draft, Sampling())
    assert out.sampled_token_ids.tolist() == [[2, -1, -1, -1, -1], [6, -1, -1, -1, -1], [0, -1, -1, -1, -1]]


def test_reordered_and_new_requests_find_their_own_trees(dd):
    step = Step(dd)
    step.prepare(req_ids=("b", "c", "a"))
    assert step.rt._step.parent.tolist()[1] == [-1, -1, -1, -1]  # c has no tree
    assert step.rt._step.has_tree.tolist() == [True, False, True]


def test_sampled_rows_follow_the_target_distribution_and_greedy_rows_the_argmax(dd):
    step = Step(dd)
    step.prepare()
    torch.manual_seed(0)
    choices = [*[1, 0, 0, 3, 5], 6, *[0, 2, 0, 0, 0]]  # b, c, a
    logits = one_hot_rows(choices) * 5  # the chosen token has probability ~1 at temperature 1
    sampling = Sampling(
        all_greedy=False,
        temperature=torch.tensor([1.0, 0.0, 0.7]),
        top_p=torch.tensor([0.9, 1.0, 0.9]),
        top_k=torch.tensor([3, 8, 3]),
    )
    out = step.rt.sample(logits, step.input_ids, step.num_draft, sampling)
    assert out.sampled_token_ids.tolist() == [[1, 3, 5, -1, -1], [6, -1, -1, -1, -1], [0, 2, -1, -1, -1]]


def test_budget_below_depth_is_refused(dd):
    with pytest.raises(ValueError, match="budget 3 < drafter depth 4"):
        dd.DDTreeRuntime(budget=3, depth=4, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)


def test_mrope_rows_get_the_depth_positions_and_parent_rows_are_published(dd):
    """M-RoPE targets read three position rows: all three move with the tree depth, then come back."""
    step = Step(dd)
    # Text tokens: the three rows equal the position plus the request's M-RoPE delta (here 100).
    mrope = (step.positions + 100).repeat(3, 1)
    before = mrope.clone()
    step.prepare(mrope_positions=mrope)
    want = [110, 111, 112, 111, 112, 100, 101, 102, 120, 121, 122, 121, 122]
    assert mrope.tolist() == [want] * 3
    # Parent rows within each request (-1 for the root; the prefill c continues row by row).
    assert dd.current_tree_parents()[:13].tolist() == [-1, 0, 1, 0, 3, -1, 0, 1, -1, 0, 1, 0, 3]
    # Past the step: chains of N+1 rows, as the buffer was made for graph capture.
    assert dd.current_tree_parents()[13:].tolist() == [2, 3, -1]
    choices = [*[1, 0, 0, 3, 5], 6, *[0, 2, 0, 0, 0]]
    step.rt.sample(one_hot_rows(choices), step.input_ids, step.num_draft, Sampling())
    assert dd.current_tree_parents() is step.rt.tree_parents
    slots = torch.arange(13)
    step.rt.compact([(slots, [torch.zeros(2, 4, 4, 1, 2)])], [], step.positions, mrope_positions=mrope)
    assert torch.equal(mrope, before)


def _step_with_path(dd, accepted: list[list[int]], query_start: list[int]):
    """A step whose walk accepted the given node paths (-1 padded), for compact() alone."""
    r, n = len(accepted), 4
    z = torch.zeros(r, n, dtype=torch.int64)
    return dd._StepTrees(
        num_reqs=r,
        has_drafts=torch.ones(r, dtype=torch.bool),
        has_tree=torch.ones(r, dtype=torch.bool),
        num_drafts=torch.full((r,), n),
        query_start=torch.tensor(query_start),
        parent=z,
        depth=z,
        ancestor_mask=torch.zeros(r, n + 1, n + 1, dtype=torch.bool),
        seq_positions=torch.arange(5 * r),
        accepted_nodes=torch.tensor(accepted),
        num_accepted=(torch.tensor(accepted) >= 0).sum(1),
    )


def test_a_moved_node_may_land_on_the_row_another_moved_node_leaves(dd):
    rt = dd.DDTreeRuntime(budget=4, depth=3, device=torch.device("cpu"), max_num_reqs=2, max_num_tokens=10)
    # Request 0 accepted nodes 1 then 2 (rows 2, 3 -> 1, 2: row 2 is read before it is written);
    # request 1 accepted nothing.
    rt._step = _step_with_path(dd, [[1, 2, -1], [-1, -1, -1]], [0, 5])
    slots = torch.arange(10)
    cache = torch.arange(10, dtype=torch.float32).view(1, 10, 1, 1, 1).repeat(2, 1, 1, 1, 1)
    hidden = torch.arange(10, dtype=torch.float32)
    rt.compact([(slots, [cache.view(2, 10, 1, 1, 1)])], [hidden], torch.zeros(10, dtype=torch.int64))
    assert hidden.tolist() == [0, 2, 3, 3, 4, 5, 6, 7, 8, 9]
    assert cache[1, :, 0, 0, 0].tolist() == [0, 2, 3, 3, 4, 5, 6, 7, 8, 9]


def test_compaction_that_moves_nothing_leaves_every_row_as_it_was(dd):
    rt = dd.DDTreeRuntime(budget=4, depth=3, device=torch.device("cpu"), max_num_reqs=2, max_num_tokens=10)
    rt._step = _step_with_path(dd, [[0, 1, 2], [-1, -1, -1]], [0, 5])  # a path already in place
    cache = torch.randn(2, 5, 2, 1, 3)
    before = cache.clone()
    hidden = torch.randn(10, 4)
    kept = hidden.clone()
    rt.compact([(torch.arange(10), [cache])], [hidden], torch.zeros(10, dtype=torch.int64))
    assert torch.equal(cache, before) and torch.equal(hidden, kept)


def test_allowed_token_ids_limit_the_targets_choice_at_every_row(dd):
    step = Step(dd)
    step.prepare()
    choices = [*[1, 0, 0, 3, 5], 6, *[0, 2, 0, 0, 0]]  # b, c, a: b's path is 1 -> 3 -> bonus 5
    logits = one_hot_rows(choices)
    logits[:, 2] = 5.0  # token 2 is every row's second best
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, 3] = True  # b may not produce 3: its path stops after 1, whose row now picks 2
    out = step.rt.sample(logits, step.input_ids, step.num_draft, Sampling(allowed_token_ids_mask=mask))
    assert out.sampled_token_ids.tolist()[0] == [1, 2, -1, -1, -1]
    assert out.sampled_token_ids.tolist()[1:] == [[6, -1, -1, -1, -1], [0, 2, -1, -1, -1]]


def test_rows_are_chosen_in_chunks_with_the_same_result(dd, monkeypatch):
    torch.manual_seed(1)
    rt = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
    logits = torch.randn(13, 50)
    row_req = torch.tensor([0] * 5 + [1] * 3 + [2] * 5)
    # Temperature 0 in a batch that is not all greedy: the chunked path, row by row greedy.
    mixed = Sampling(all_greedy=False, temperature=torch.zeros(3))
    whole = rt._target_choices(logits, row_req, mixed)
    monkeypatch.setattr(dd, "_CHOICE_ROWS", 4)
    assert torch.equal(rt._target_choices(logits, row_req, mixed), whole)
    assert torch.equal(whole, logits.argmax(-1))


def test_a_greedy_batch_takes_the_argmax_of_the_logits_as_they_are(dd):
    rt = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
    logits = torch.randn(9, 50).to(torch.bfloat16)
    logits[3, 7] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index, as float32 gives it
    row_req = torch.tensor([0] * 5 + [1] * 4)
    choices = rt._target_choices(logits, row_req, Sampling())
    assert torch.equal(choices, logits.float().argmax(-1))
    assert int(choices[3]) == 7


@dataclass
class Params:
    """The SamplingParams fields unsupported_request reads, at vLLM's defaults."""

    logprobs: int | None = None
    structured_outputs: object = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bad_words: list = field(default_factory=list)
    min_tokens: int = 0
    seed: int | None = None
    temperature: float = 1.0
    min_p: float = 0.0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"logprobs": 0}, "logprobs (tree steps return none)"),
        ({"structured_outputs": object()}, "structured outputs"),
        ({"presence_penalty": 0.5}, "presence, frequency or repetition penalties"),
        ({"frequency_penalty": -0.2}, "presence, frequency or repetition penalties"),
        ({"repetition_penalty": 1.1}, "presence, frequency or repetition penalties"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"min_tokens": 3}, "min_tokens"),
        ({"seed": 7}, "a per-request seed when sampling"),
    ],
)
def test_requests_trees_cannot_serve_as_the_target_would_are_refused_with_the_reason(dd, change, named):
    reason = dd.unsupported_request(Params(**change))
    assert reason.startswith("DDTree tree verification (speculative method 'ddtree') cannot honour ")
    assert named in reason
    assert reason.endswith("Send the request without them, or serve this model with method 'dflash'.")


def test_plain_requests_and_greedy_seeded_ones_are_served(dd):
    assert dd.unsupported_request(Params()) is None
    assert dd.unsupported_request(Params(seed=7, temperature=0.0)) is None  # greedy: the seed changes nothing
    assert dd.unsupported_request(Params(temperature=0.8, min_p=0.1)) is None  # vLLM refuses min_p itself
    both = dd.unsupported_request(Params(logprobs=1, min_tokens=2))
    assert "logprobs (tree steps return none); min_tokens." in both


def test_a_request_the_scheduler_skipped_for_a_step_keeps_its_tree(dd):
    step = Step(dd)  # trees of a and b built
    b_tree = step.rt.build(DRAFT_LOGITS[1:], ["b"])  # the next step drafted b alone: a waited
    assert b_tree.tolist() == [step.tokens[1]]
    step.prepare()  # a comes back with the drafts of its earlier tree
    assert step.rt._step.has_tree.tolist() == [True, False, True]
    assert step.rt._step.parent.tolist()[2] == [-1, 0, -1, 2]  # a's own tree, not a star


def test_kept_trees_are_bounded_by_one_batch(dd):
    rt = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=1, max_num_tokens=16)
    rt.build(DRAFT_LOGITS, ["a", "b"])
    rt.build(DRAFT_LOGITS[:1], ["c"])
    assert list(rt._stored.req_index) == ["c", "a"]  # b's tree is dropped: one batch of waiting trees
    assert rt._stored.parent.shape[0] == 2


def build_copies(dd, monkeypatch) -> list[list[int]]:
    """The host lists the runtime module itself turns into tensors (its ``torch.tensor`` calls): in
    ``build`` only the rows of waiting trees, copied to the device. Made with a device, such a
    tensor is a copy from pageable memory, which makes the host wait for the GPU's queue: the
    module must build it on the host and move it without blocking (so none here has a device)."""
    copies: list[list[int]] = []
    real = torch.tensor

    def tensor(data, *args, **kwargs):
        if sys._getframe(1).f_code.co_filename == dd.__file__:
            assert "device" not in kwargs, "a host list copied from pageable memory: the host waits for the GPU"
            copies.append(list(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    return copies


def test_a_finished_request_leaves_no_tree_behind_and_the_build_copies_nothing(dd, monkeypatch):
    step = Step(dd)  # trees of a and b built
    copies = build_copies(dd, monkeypatch)
    step.rt.forget_requests(["a"])  # the runner: a finished
    step.rt.build(DRAFT_LOGITS[1:], ["b"])
    assert list(step.rt._stored.req_index) == ["b"]
    assert step.rt._stored.parent.shape[0] == 1
    assert copies == []
    for _ in range(3):  # and so every later step
        step.rt.build(DRAFT_LOGITS[1:], ["b"])
    assert list(step.rt._stored.req_index) == ["b"]
    assert copies == []
    step.prepare()  # were a to come back with drafts (never: it finished), it would find no tree
    assert step.rt._step.has_tree.tolist() == [True, False, False]


def test_a_skipped_request_keeps_its_tree_while_a_finished_one_is_forgotten(dd, monkeypatch):
    step = Step(dd)  # trees of a and b built
    copies = build_copies(dd, monkeypatch)
    step.rt.forget_requests(["b", "gone"])  # b finished; an id the runtime never saw is ignored
    step.rt.build(DRAFT_LOGITS[1:], ["c"])  # a was skipped: it waits
    assert list(step.rt._stored.req_index) == ["c", "a"]
    assert copies == [[0]]  # a's row, and only it
    step.prepare(req_ids=("c", "x", "a"))  # a comes back with its own tree
    assert step.rt._step.has_tree.tolist() == [True, False, True]
    assert step.rt._step.parent.tolist()[2] == [-1, 0, -1, 2]
    assert step.rt._stored.tokens.tolist()[1] == step.tokens[0]


def test_forgetting_before_any_build_changes_nothing(dd):
    rt = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
    rt.forget_requests(["a"])
    assert rt._stored is None


@pytest.mark.parametrize("drafts_a", [4, 2])  # 2: the scheduler cut a's drafts (token budget, max_model_len)
def test_under_async_scheduling_a_request_the_scheduler_skipped_is_verified_against_its_own_tree(dd, drafts_a):
    step = Step(dd, drafts_a=drafts_a)  # the step that drafted a and b
    step.rt.build(DRAFT_LOGITS[1:], ["b"])  # the next step drafted b alone: a waited
    # a comes back. It was not in the last step, so vLLM scattered no drafts in for it: its
    # draft rows hold the scheduler's placeholders. b's were scattered in from its tree.
    step.input_ids[9:] = -1
    before = step.input_ids.clone()
    step.prepare(input_ids=step.input_ids, from_last_step=[True, False, False])
    assert step.input_ids[9:].tolist() == step.tokens[0][:drafts_a]  # a's own tree's tokens
    assert torch.equal(step.input_ids[:9], before[:9])  # b's drafts, c's prefill and a's root as they were
    assert step.rt._step.has_tree.tolist() == [True, False, True]
    assert step.rt._step.parent.tolist()[2] == [-1, 0, -1, 2]
    # a: root->0 (node 0), node 0->0 (node 1), node 1->2: accepts two tokens and the bonus.
    choices = [*[1, 0, 0, 3, 5], 6, *[0, 0, 2, 0, 0][: drafts_a + 1]]  # b, c, a
    out = step.rt.sample(one_hot_rows(choices), step.input_ids, step.num_draft, Sampling())
    assert out.sampled_token_ids.tolist()[2] == [0, 0, 2, -1, -1]


def test_under_async_scheduling_requests_of_the_last_step_keep_the_drafts_scattered_in(dd):
    step = Step(dd)
    before = step.input_ids.clone()
    step.prepare(input_ids=step.input_ids, from_last_step=[True, True, True])
    assert torch.equal(step.input_ids, before)
    assert step.rt._step.has_tree.tolist() == [True, False, True]


@pytest.mark.parametrize(
    ("last_position", "fits"),
    # max_model_len 100: the block's last position must be a position of the model (below 100)
    [(99, True), (100, False), (105, False)],
)
def test_a_drafter_block_past_max_model_len_is_kept_inside_its_own_cache(dd, last_position, fits):
    rt = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
    # Each request's drafter block: its bonus token and depth (2) mask tokens.
    positions = torch.tensor([[10, 11, 12], [last_position - 2, last_position - 1, last_position]])
    slots = torch.tensor([[410, 411, 412], [898, 899, 900]])
    seq_lens = torch.tensor([13, last_position + 1], dtype=torch.int32)
    drafted = rt.limit_draft_blocks(positions, slots, seq_lens, 100)
    assert drafted.tolist() == [True, fits]
    assert positions[0].tolist() == [10, 11, 12] and slots[0].tolist() == [410, 411, 412]
    assert seq_lens[0] == 13
    if fits:
        assert positions[1].tolist() == [97, 98, 99] and slots[1].tolist() == [898, 899, 900]
        assert seq_lens[1] == 100
    else:
        # positions 0..depth of its own cache, no KV written, attending to that block alone
        assert positions[1].tolist() == [0, 1, 2] and slots[1].tolist() == [-1, -1, -1]
        assert seq_lens[1] == 3


def test_a_request_near_max_model_len_stops_drafting_for_itself_only(dd):
    step = Step(dd)
    # b's drafter block did not fit: its drafts are tokens of no tree; a's did.
    step.tokens = step.rt.build(DRAFT_LOGITS, ["a", "b"], drafted=torch.tensor([True, False])).tolist()
    step.prepare()
    assert step.rt._step.has_drafts.tolist() == [True, False, True]
    assert step.rt._step.has_tree.tolist() == [False, False, True]
    # b's choices would accept [1, 3] on its tree: verified as rejected, it keeps only its bonus.
    choices = [*[1, 0, 0, 3, 5], 6, *[0, 0, 2, 0, 0]]  # b, c, a
    out = step.rt.sample(one_hot_rows(choices), step.input_ids, step.num_draft, Sampling())
    assert out.sampled_token_ids.tolist() == [[1, -1, -1, -1, -1], [6, -1, -1, -1, -1], [0, 0, 2, -1, -1]]


def test_a_waiting_tree_keeps_whether_its_block_fitted(dd):
    rt = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=16)
    rt.build(DRAFT_LOGITS, ["a", "b"], drafted=torch.tensor([True, False]))
    rt.build(DRAFT_LOGITS[:1], ["c"])  # a and b wait
    assert list(rt._stored.req_index) == ["c", "a", "b"]
    assert rt._stored.drafted.tolist() == [True, True, False]
    assert rt._stored.tokens.tolist() == [[0, 0, 1, 0], [0, 0, 1, 0], [2, 3, 1, 3]]


@pytest.mark.parametrize(
    ("max_num_reqs", "scheduled_tokens", "chunks"),
    # 4 x (4 + 1) rows; or no more than the scheduler puts in a step (below the runner's 64 tokens)
    [(4, 64, [8, 8, 4]), (8, 16, [8, 8])],
)
def test_the_memory_profile_holds_a_full_tree_step(dd, monkeypatch, max_num_reqs, scheduled_tokens, chunks):
    rt = dd.DDTreeRuntime(budget=4, depth=2, device=torch.device("cpu"), max_num_reqs=max_num_reqs, max_num_tokens=64)
    monkeypatch.setattr(dd, "_CHOICE_ROWS", 8)
    lm_head = torch.randn(50, 6)
    logits_rows, sampled_chunks, made, empties = [], [], [], []
    real_empty = torch.empty

    def empty(*size, **kwargs):
        out = real_empty(*size, **kwargs)
        empties.append(weakref.ref(out))
        return out

    def compute_logits(hidden):
        # Rows asked for, whether the logits made before are still held (as in
        # a real step), and which empty tensors are held beside them.
        held = [tuple(e().shape) for e in empties if e() is not None]
        logits_rows.append((hidden.shape[0], [m() is not None for m in made], held))
        out = hidden @ lm_head.T
        made.append(weakref.ref(out))
        return out

    choices = rt._choices

    def sampled(logits, row_req, sampling):
        sampled_chunks.append((logits.shape[0], sampling.all_greedy, sampling.allowed_token_ids_mask.shape))
        return choices(logits, row_req, sampling)

    monkeypatch.setattr(rt, "_choices", sampled)
    monkeypatch.setattr(torch, "empty", empty)
    # The dummy forward's hidden states cover the runner's 64 tokens; 3 captured layers of width 6.
    rt.profile_step_memory(torch.randn(64, 6), compute_logits, scheduled_tokens=scheduled_tokens, captured_layers=3)
    captured = (scheduled_tokens * 2 * 3 * 6 * 4,)  # each float32 layer's states and their concatenation, in bytes
    # The verified rows, then every request's drafter logits at every depth while those are held,
    # and the captured hidden states held throughout.
    assert logits_rows == [(sum(chunks), [], [captured]), (max_num_reqs * 2, [True], [captured])]
    # Every verified row sampled, 8 at a time, with top-k/top-p and an allowed-token mask.
    assert [n for n, _, _ in sampled_chunks] == chunks
    assert {(greedy, mask) for _, greedy, mask in sampled_chunks} == {(False, (max_num_reqs, 50))}


@pytest.mark.parametrize(
    ("dtype", "per_layer_and_width"),
    [
        (torch.bfloat16, 2 * 2),  # the states and their concatenation
        (torch.float32, 2 * 4),
        (torch.float16, 2 * 4 + 2),  # float32 under fp16 (Gemma-style norms), and the drafter's fp16 cast
    ],
)
def test_captured_states_are_counted_as_the_target_keeps_them(dd, dtype, per_layer_and_width):
    assert dd.captured_bytes_per_token(5, 5120, dtype) == 5 * 5120 * per_layer_and_width
    assert dd.captured_bytes_per_token(0, 5120, dtype) == 0
