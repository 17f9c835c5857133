"""DDTree under tensor parallelism (TP=2), the parts that can be checked on the CPU.

vLLM 0.20.1 runs one worker process per TP rank and does not broadcast sampled tokens between
them: each rank builds its own trees from the drafter's all-gathered logits, walks them with its
own sampler, and compacts its own KV and recurrent-state shards. Meanwhile the draft tokens the
scheduler sends back (synchronous scheduling) are rank 0's. So every rank must build the same tree
from the same bytes, bit for bit, and the per-rank (head-sharded) state paths must compute, for
their heads, exactly what the unsharded run computes. Two runtimes in one process stand in for
the two ranks here; each head half of the Gated DeltaNet kernels stands in for one rank's shard.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ddtree.tests import release_files
from ddtree.tests.vllm_modules import (
    GDN_KERNELS,
    TREE_PARENTS,
    committed_tree_step,
    load_ddtree_runtime,
    load_gdn_kernels,
)

INTERPRETER = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="runs the kernels in Triton's interpreter (CPU)")


@pytest.fixture(scope="module", autouse=True)
def no_vllm_left_behind():
    """The stand-in vllm modules go when this module's tests end (other tests check that vLLM
    itself was never imported)."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "vllm" or name.startswith("vllm."):
            del sys.modules[name]


@pytest.fixture(scope="module")
def dd():
    return load_ddtree_runtime()


class Sampling:
    """The sampling metadata fields the runtime reads."""

    def __init__(self, temperature=None):
        self.all_greedy = temperature is None
        self.temperature = temperature
        self.top_k = None
        self.top_p = None
        self.allowed_token_ids_mask = None


R, D, V, N = 3, 3, 16, 7  # requests, drafter depth, vocabulary, budget


def tied_logits(seed: int) -> torch.Tensor:
    """Drafter logits with many exact ties (few distinct values), where a tree's order is decided
    by the tie-break rule alone: the hardest case for two ranks to agree on."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (R, D, V), generator=g).float()


def rank(dd):
    return dd.DDTreeRuntime(budget=N, depth=D, device=torch.device("cpu"), max_num_reqs=4, max_num_tokens=64)


def verify(rt, scheduled: torch.Tensor, target_logits: torch.Tensor, sampling: Sampling):
    """One verification step of requests r0..r2, each with its N drafts (``scheduled``, the
    tokens the scheduler sent back): the runtime's step buffers, output and compaction moves."""
    qlen = N + 1
    qsl = torch.arange(R + 1) * qlen
    num_computed = torch.tensor([10, 20, 30], dtype=torch.int32)
    req_indices = torch.arange(R).repeat_interleave(qlen)
    query_pos = torch.arange(qlen).repeat(R)
    positions = num_computed[req_indices].long() + query_pos
    input_ids = torch.cat([torch.cat([torch.tensor([99]), scheduled[r]]) for r in range(R)])
    rt.prepare_step(["r0", "r1", "r2"], [N] * R, qsl, num_computed, req_indices, query_pos, positions)
    out = rt.sample(target_logits, input_ids, [N] * R, sampling).sampled_token_ids
    src, dst = rt._moves(rt._step)
    return {
        "positions": positions.clone(),
        "bias": rt.attn_bias.clone(),
        "parents": rt.tree_parents.clone(),
        "out": out,
        "src": src,
        "dst": dst,
    }


def assert_same(a: dict, b: dict) -> None:
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ---------------------------------------------------------------------------
# (1) the same tree on every rank
@pytest.mark.parametrize("seed", range(4))
def test_repeated_builds_of_the_same_logits_are_bit_identical(dd, seed):
    """Rank 0 and rank 1 hold the same all-gathered bytes (in different memory): every build gives
    the same tokens, parents, depths and ancestor masks, also after other builds in between."""
    logits = tied_logits(seed)
    rank0, rank1 = rank(dd), rank(dd)
    first = rank0.build(logits, ["r0", "r1", "r2"])
    stored = rank0._stored
    for _ in range(3):
        rank1.build(tied_logits(seed + 100), ["r0", "r1", "r2"])  # other steps in between
        again = rank1.build(logits.clone(), ["r0", "r1", "r2"])
        assert torch.equal(again, first)
        for name in ("parent", "depth", "ancestor_mask"):
            assert torch.equal(getattr(rank1._stored, name), getattr(stored, name)), name


@pytest.mark.parametrize("greedy", [True, False])
def test_two_ranks_verifying_rank_0s_tokens_take_the_same_step(dd, greedy):
    """Each rank walks its own tree over the tokens rank 0 proposed, with its own sampler (vLLM
    seeds every worker alike): positions, bias, parent rows, accepted tokens and KV moves agree."""
    logits = tied_logits(7)
    rank0, rank1 = rank(dd), rank(dd)
    scheduled = rank0.build(logits, ["r0", "r1", "r2"])
    rank1.build(logits.clone(), ["r0", "r1", "r2"])
    g = torch.Generator().manual_seed(3)
    target = torch.randn(R * (N + 1), V, generator=g) * 3
    # The target mostly follows the tree's first branch, so something is accepted.
    target[torch.arange(R) * (N + 1), scheduled[:, 0]] += 50
    sampling = Sampling(None if greedy else torch.tensor([1.0, 0.0, 0.7]))
    torch.manual_seed(11)
    step0 = verify(rank0, scheduled, target, sampling)
    torch.manual_seed(11)
    step1 = verify(rank1, scheduled, target.clone(), sampling)
    assert_same(step0, step1)
    assert (step0["out"][:, 0] == scheduled[:, 0]).all()  # the first node was accepted


def test_a_rank_whose_logits_differ_by_one_ulp_can_build_another_tree_and_diverge(dd):
    """Why the ranks' drafter logits must be bit-identical: the tree is a discontinuous function of
    them. Budget 2: the second node is either token 2 at depth 1 or token 3 after token 1 (depth 2),
    whichever prefix scores more; there are two logits one float32 ulp apart on either side of that
    tie. A rank verifying rank 0's tokens with the other tree accepts something else (its KV,
    recurrent state and accepted count then differ from rank 0's: silent corruption)."""

    def logits_with(x: float) -> torch.Tensor:
        logits = torch.zeros(1, 2, 8)
        logits[0, 0, 1] = 5.0
        logits[0, 0, 2] = x  # depth 1: token 1 first, token 2 somewhere below
        logits[0, 1, 3] = 2.0  # depth 2: token 3 likely, but not certain
        return logits

    def structure(x: float) -> list[int]:
        rt = dd.DDTreeRuntime(budget=2, depth=2, device=torch.device("cpu"), max_num_reqs=2, max_num_tokens=8)
        rt.build(logits_with(x), ["r0"])
        return rt._stored.depth[0].tolist()

    def as_float(bits: int) -> float:
        return torch.tensor(bits, dtype=torch.int32).view(torch.float32).item()

    lo = torch.tensor(0.0).view(torch.int32).item()  # token 2 improbable: [1, 2] depths (1, 3 chain)
    hi = torch.tensor(5.0).view(torch.int32).item()  # token 2 ties token 1: depths [1, 1]
    assert structure(as_float(lo)) == [1, 2] and structure(as_float(hi)) == [1, 1]
    while hi - lo > 1:  # positive floats order as their bit patterns
        mid = (lo + hi) // 2
        if structure(as_float(mid)) == [1, 2]:
            lo = mid
        else:
            hi = mid
    x0, x1 = as_float(lo), as_float(hi)  # one ulp apart
    assert torch.nextafter(torch.tensor(x0), torch.tensor(6.0)).item() == x1

    def step(rt, scheduled):
        rt.prepare_step(
            ["r0"],
            [2],
            torch.tensor([0, 3]),
            torch.tensor([10]),
            torch.zeros(3, dtype=torch.int64),
            torch.arange(3),
            torch.arange(10, 13),
        )
        target = torch.zeros(3, 8)
        target[0, 1] = 9.0  # after the root the target takes token 1 ...
        target[1:, 3] = 9.0  # ... and then token 3
        ids = torch.cat([torch.tensor([0]), scheduled[0]])
        return rt.sample(target, ids, [2], Sampling()).sampled_token_ids

    rank0 = dd.DDTreeRuntime(budget=2, depth=2, device=torch.device("cpu"), max_num_reqs=2, max_num_tokens=8)
    rank1 = dd.DDTreeRuntime(budget=2, depth=2, device=torch.device("cpu"), max_num_reqs=2, max_num_tokens=8)
    scheduled = rank0.build(logits_with(x0), ["r0"])  # the tokens the scheduler sends every rank
    rank1.build(logits_with(x1), ["r0"])
    assert not torch.equal(rank1._stored.parent, rank0._stored.parent)
    assert step(rank0, scheduled).tolist() == [[1, 3, 3]]  # the chain 1, 3 accepted, bonus 3
    assert step(rank1, scheduled).tolist() == [[1, 3, -1]]  # rank 1: token 3 is a root child, one accepted


# ---------------------------------------------------------------------------
# (2), (3) head-sharded recurrent state: each rank's half is the unsharded run's half
@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return load_gdn_kernels(release_files.patched(list(GDN_KERNELS.values())), tmp_path_factory.mktemp("patched"))


H_FULL, HV_FULL, K, VD = 2, 4, 16, 16  # key heads, value heads (2 value heads per key head), dims
PARENTS = list(TREE_PARENTS)  # one request's rows: siblings, a branch off row 2
WIDTH, DIM = 4, 32  # convolution width, channels (sharded by TP too)


def recurrent_step(mod, inputs, h0, heads: slice, key_heads: slice):
    rows = len(PARENTS)
    state = torch.zeros(1 + rows, heads.stop - heads.start, VD, K)
    indices = torch.arange(1, rows + 1, dtype=torch.int32).view(1, rows)
    state[1] = h0[heads]
    out, _ = mod.fused_sigmoid_gating_delta_rule_update(
        A_log=inputs["A_log"][heads].contiguous(),
        dt_bias=inputs["dt_bias"][heads].contiguous(),
        a=inputs["a"][:, heads].contiguous(),
        b=inputs["b"][:, heads].contiguous(),
        q=inputs["q"][:, :, key_heads].contiguous(),
        k=inputs["k"][:, :, key_heads].contiguous(),
        v=inputs["v"][:, :, heads].contiguous(),
        initial_state=state,
        inplace_final_state=True,
        cu_seqlens=torch.tensor([0, rows], dtype=torch.int32),
        ssm_state_indices=indices,
        num_accepted_tokens=torch.tensor([1], dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
        parent_rows=torch.tensor(PARENTS, dtype=torch.int32),
    )
    return out.squeeze(0), state


@needs_interpreter
def test_a_rank_with_half_the_value_heads_computes_its_heads_as_the_unsharded_tree_step(
    kernels, interpreter_scalar_index
):
    """GDN's tree path on a rank (num_v_heads / 2 and num_k_heads / 2, vLLM's head sharding)
    gives exactly the unsharded run's outputs and per-row states for those heads."""
    g = torch.Generator().manual_seed(5)
    t = len(PARENTS)
    inputs = dict(
        A_log=torch.randn(HV_FULL, generator=g) * 0.5,
        dt_bias=torch.randn(HV_FULL, generator=g) * 0.5,
        a=torch.randn(t, HV_FULL, generator=g),
        b=torch.randn(t, HV_FULL, generator=g),
        q=torch.randn(1, t, H_FULL, K, generator=g),
        k=torch.randn(1, t, H_FULL, K, generator=g),
        v=torch.randn(1, t, HV_FULL, VD, generator=g),
    )
    h0 = torch.randn(HV_FULL, VD, K, generator=g) * 0.1
    mod = kernels["fused_sigmoid_gating"]
    full_out, full_state = recurrent_step(mod, inputs, h0, slice(0, HV_FULL), slice(0, H_FULL))
    half = HV_FULL // 2
    for r in range(2):
        heads, key_heads = slice(r * half, (r + 1) * half), slice(r, r + 1)
        out, state = recurrent_step(mod, inputs, h0, heads, key_heads)
        assert torch.equal(out, full_out[:, heads]), f"rank {r} outputs"
        assert torch.equal(state, full_state[:, heads]), f"rank {r} states"


@needs_interpreter
def test_a_rank_with_half_the_channels_convolves_its_channels_as_the_unsharded_tree_step(
    kernels, interpreter_scalar_index
):
    g = torch.Generator().manual_seed(9)
    rows = len(PARENTS)
    x = torch.randn(rows, DIM, generator=g)
    state = torch.randn(2, DIM, WIDTH - 1 + rows - 1, generator=g)
    weight = torch.randn(DIM, WIDTH, generator=g)
    bias = torch.randn(DIM, generator=g)

    def run(channels: slice):
        s = state[:, channels].clone()
        out = kernels["causal_conv1d"].causal_conv1d_update(
            x[:, channels].clone(),  # the kernel writes its output over x
            s,
            weight[channels].contiguous(),
            bias[channels].contiguous(),
            "silu",
            conv_state_indices=torch.tensor([1], dtype=torch.int32),
            num_accepted_tokens=torch.tensor([1], dtype=torch.int32),
            query_start_loc=torch.tensor([0, rows], dtype=torch.int32),
            max_query_len=rows,
            parent_rows=torch.tensor(PARENTS, dtype=torch.int32),
        )
        return out, s

    full_out, full_state = run(slice(0, DIM))
    half = DIM // 2
    for r in range(2):
        channels = slice(r * half, (r + 1) * half)
        out, s = run(channels)
        assert torch.equal(out, full_out[:, channels]), f"rank {r} outputs"
        assert torch.equal(s, full_state[:, channels]), f"rank {r} window"


def test_each_rank_commits_its_shard_of_the_accepted_path_as_the_unsharded_commit(dd):
    """``compact`` on a rank's conv/SSM shards (channels and value heads halved) and on its KV
    shard (KV heads halved) moves exactly the unsharded commit's data for that shard: it indexes
    slots, lines and rows only, never a head."""
    n = len(PARENTS) - 1
    g = torch.Generator().manual_seed(2)
    conv = torch.randn(3, DIM, WIDTH - 1 + n, generator=g)
    ssm = torch.randn(8, HV_FULL, VD, K, generator=g)
    kv = torch.randn(2, 4, 4, 2, 8, generator=g)  # [2, blocks, block size, KV heads, head dim]
    slot_mapping = torch.arange(4, 4 + n + 1)

    def commit(conv, ssm, kv):
        rt = dd.DDTreeRuntime(budget=n, depth=3, device=torch.device("cpu"), max_num_reqs=2, max_num_tokens=16)
        rt._step = committed_tree_step(dd)
        slots = torch.tensor([[1, 2, 3, 4, 5, 6]])
        rt.compact(
            [(slot_mapping, [kv])],
            [],
            torch.zeros(n + 1, dtype=torch.int64),
            recurrent=[dd.RecurrentGroup(conv_states=[conv], ssm_states=[ssm], state_slots=slots, width=WIDTH)],
        )

    full = conv.clone(), ssm.clone(), kv.clone()
    commit(*full)
    assert not torch.equal(full[1], ssm)  # the commit moved something
    for r in range(2):
        shard = (
            conv[:, r * DIM // 2 : (r + 1) * DIM // 2].clone(),
            ssm[:, r * HV_FULL // 2 : (r + 1) * HV_FULL // 2].clone(),
            kv[:, :, :, r : r + 1].clone(),
        )
        commit(*shard)
        assert torch.equal(shard[0], full[0][:, r * DIM // 2 : (r + 1) * DIM // 2]), f"rank {r} conv"
        assert torch.equal(shard[1], full[1][:, r * HV_FULL // 2 : (r + 1) * HV_FULL // 2]), f"rank {r} ssm"
        assert torch.equal(shard[2], full[2][:, :, :, r : r + 1]), f"rank {r} kv"
