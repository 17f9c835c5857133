# SPDX-License-Identifier: Apache-2.0
"""DDTree verification for DFlash drafts in the vLLM 0.20.1 GPU model runner.

DDTree (arXiv 2604.12989) turns one DFlash drafter pass into a tree of
``budget`` draft tokens (the most probable prefixes under the drafter's
per-position distributions) and verifies the whole tree in one target pass.

How it rides on the DFlash machinery of this release:

* The scheduler and the target see ``num_speculative_tokens = budget`` draft
  tokens per request: the tree's nodes in build order (parents before
  children). The drafter keeps its own depth (block size - 1).
* ``prepare_step`` (after the runner computed slot mappings) gives every draft
  token its depth-based position (root position + depth) and hands the
  TREE_ATTN backend one ancestor-only attention bias per request.
* ``sample`` takes the target's choice at every node (argmax when greedy, a
  sample of the temperature/top-k/top-p distribution otherwise), walks each
  tree from the root (``ddtree_tree.walk_trees``) and returns the accepted
  path's tokens plus the bonus token in the rejection sampler's layout.
* ``compact`` moves the accepted nodes' target KV and hidden states onto the
  consecutive slots of the accepted path, so the KV cache, the scheduler's
  token accounting and the DFlash drafter (fed the accepted nodes' hidden
  states) see a plain sequence again.
* ``build`` turns the drafter's logits into the next step's trees; a request
  whose drafter block (its bonus token and ``depth`` draft positions) would
  pass max_model_len gets none (``limit_draft_blocks``), the others keep theirs.

On hybrid targets (Gated DeltaNet layers, e.g. Qwen3.5/3.6) the verified
tokens' recurrent state follows the tree too: ``current_tree_parents`` gives
the GDN kernels each token's parent row, so a node continues its parent's
convolution window and recurrent state (every row's state goes to its own
state slot, as in a chain). ``compact`` then commits the accepted path into
the request's first slot and the start of its convolution window, the place
every next step reads, with or without drafts (``resume_recurrent_state``
sets the runner's accepted-token count to 1 to match). M-RoPE targets get the
same depth-based positions in all three position rows.

Trees are kept per request id between steps, so requests may join, leave or
be reordered; under async scheduling a request the scheduler skipped for a
step comes back with placeholder drafts, which ``prepare_step`` replaces with
its stored tree's tokens. A finished request's tree is dropped when the runner
reports it (``forget_requests``). Requests with draft tokens but no tree (their
drafter block did not fit before max_model_len) verify nothing and still get
their bonus token.
Requests that ask for what trees cannot give as the target alone would
(logprobs, structured outputs, penalties, bad words, min_tokens, a seed when
sampling) are refused when they arrive, with the reason (``unsupported_request``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.logger import init_logger
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.spec_decode.ddtree_tree import DDTree, build_trees, walk_trees

try:
    from vllm.v1.spec_decode import ddtree_moves
except ImportError:  # no Triton: compact() moves each layer with torch indexing
    ddtree_moves = None

logger = init_logger(__name__)

_SAMPLING_EPS = 1e-5
_PADDING_SLOT = -1  # vLLM's PADDING_SLOT_ID: the KV-cache writes skip it
_CHOICE_ROWS = 128  # target rows sampled at once (each needs a few vocab-sized float32 rows)

# The runtime of this worker process. Its bias and parent buffers are
# persistent (allocated once, written in place every step) so that a CUDA graph
# captured over the target's forward replays with this step's trees: a graph
# keeps the addresses it saw at capture, never a tensor made later.
_RUNTIME: DDTreeRuntime | None = None


def unsupported_request(params) -> str | None:
    """Why DDTree cannot serve these sampling parameters as the target alone
    would, or None. vLLM calls it when a request arrives (``SamplingParams``'
    spec-decode check), so a client gets an error, never silently other output."""
    missing = []
    if params.logprobs is not None:
        missing.append("logprobs (tree steps return none)")
    if params.structured_outputs is not None:
        missing.append(
            "structured outputs (the grammar would advance along the tree's node list as if it were a chain)"
        )
    if (
        abs(params.presence_penalty) > _SAMPLING_EPS
        or abs(params.frequency_penalty) > _SAMPLING_EPS
        or abs(params.repetition_penalty - 1.0) > _SAMPLING_EPS
    ):
        missing.append("presence, frequency or repetition penalties")
    if params.bad_words:
        missing.append("bad_words")
    if params.min_tokens > 0:
        missing.append("min_tokens")
    if params.seed is not None and params.temperature > _SAMPLING_EPS:
        missing.append("a per-request seed when sampling (tree nodes are sampled with the engine's generator)")
    if not missing:
        return None
    return (
        "DDTree tree verification (speculative method 'ddtree') cannot honour "
        + "; ".join(missing)
        + ". Send the request without them, or serve this model with method 'dflash'."
    )


def current_attn_bias() -> torch.Tensor | None:
    """Per-request attention bias ``[max_num_reqs, N+1, N+1]`` (0 allowed, -inf
    masked) read by the TREE_ATTN metadata builder; None without DDTree.
    Rows of requests without drafts are 0: the kernel's causal mask decides."""
    return None if _RUNTIME is None else _RUNTIME.attn_bias


def current_tree_parents() -> torch.Tensor | None:
    """Parent row (within its request, -1 for the root row) of every token of
    the step being verified, ``[max_num_tokens]`` int32; read by the Gated
    DeltaNet layers' spec-decode path. None without DDTree."""
    return None if _RUNTIME is None else _RUNTIME.tree_parents


@dataclass
class RecurrentGroup:
    """One KV-cache group of Gated DeltaNet layers: their convolution states
    (each ``[cache_lines, dim, window]``), recurrent states (each
    ``[slots, ...]``) and each request's state slots (row ``j`` of a verified
    request is written to ``state_slots[req, j]``; slot 0 is also its conv line)."""

    conv_states: list[torch.Tensor]
    ssm_states: list[torch.Tensor]
    state_slots: torch.Tensor  # [max_num_reqs, >= 1 + budget] int, rows in batch order
    width: int  # the convolution's kernel width


def captured_bytes_per_token(layers: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes a step keeps per scheduled token for the target's captured hidden
    states (the drafter's input): one ``[hidden]`` row per tapped layer and
    their concatenation. Targets with Gemma-style norms (Qwen3.5/3.6) capture
    them in float32 under fp16 and the drafter casts the concatenation back to
    fp16; every fp16 target is counted so (more than others keep)."""
    if dtype == torch.float16:
        return layers * hidden * (2 * torch.float32.itemsize + dtype.itemsize)
    return 2 * layers * hidden * dtype.itemsize


@dataclass
class _ProfileSampling:
    """The sampling metadata ``_target_choices`` reads, for the memory profile:
    every row sampled (the path with the most temporaries)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    allowed_token_ids_mask: torch.Tensor
    all_greedy: bool = False


@dataclass
class _StoredTrees:
    """The trees proposed at the end of a step, rows in that step's batch order."""

    req_index: dict[str, int]
    tokens: torch.Tensor  # [R, N] the draft tokens, in node order
    drafted: torch.Tensor  # [R] bool: False where the drafter block did not fit
    parent: torch.Tensor  # [R, N]
    depth: torch.Tensor  # [R, N]
    ancestor_mask: torch.Tensor  # [R, N+1, N+1]


@dataclass
class _StepTrees:
    """The trees of the batch being verified, rows in the current batch order."""

    num_reqs: int
    has_drafts: torch.Tensor  # [num_reqs] bool
    has_tree: torch.Tensor  # [num_reqs] bool: drafts with a stored, drafted tree
    num_drafts: torch.Tensor  # [num_reqs] int64
    query_start: torch.Tensor  # [num_reqs] int64
    parent: torch.Tensor  # [num_reqs, N]
    depth: torch.Tensor  # [num_reqs, N]
    ancestor_mask: torch.Tensor  # [num_reqs, N+1, N+1]
    seq_positions: torch.Tensor  # [num_tokens] positions before the override
    seq_mrope_positions: torch.Tensor | None = None  # [3, num_tokens] likewise
    accepted_nodes: torch.Tensor | None = None  # [num_reqs, D]
    num_accepted: torch.Tensor | None = None  # [num_reqs]


class DDTreeRuntime:
    def __init__(
        self,
        budget: int,
        depth: int,
        device: torch.device,
        max_num_reqs: int,
        max_num_tokens: int,
        move_kernels: bool | None = None,
    ):
        """``move_kernels``: compact with ``ddtree_moves``' kernels (one launch per
        kind of move over all layers); default on CUDA, torch indexing elsewhere."""
        global _RUNTIME
        if budget < depth:
            raise ValueError(f"ddtree budget {budget} < drafter depth {depth}")
        self.budget = budget
        self.depth = depth
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self._stored: _StoredTrees | None = None
        self._step: _StepTrees | None = None
        self._warned: set[str] = set()
        if move_kernels and ddtree_moves is None:
            raise RuntimeError("DDTree: move_kernels=True needs Triton, which is not installed")
        if move_kernels is None:
            move_kernels = device.type == "cuda" and ddtree_moves is not None
        self._move_kernels = move_kernels
        self._tables: dict[tuple[object, ...], object] = {}
        n = budget
        # A request with drafts but no stored tree: every node hangs off the
        # root at depth 1 and carries no token, so nothing is accepted.
        self._star_parent = torch.full((n,), -1, dtype=torch.int64, device=device)
        self._star_depth = torch.ones(n, dtype=torch.int64, device=device)
        star = torch.eye(n + 1, dtype=torch.bool, device=device)
        star[:, 0] = True
        self._star_mask = star
        self._node_ids = torch.arange(n + 1, device=device)
        # Persistent step buffers (see _RUNTIME). The bias starts all-allowed;
        # the parents start as chains of N+1 rows, the shape graphs are
        # captured with, so a capture reads valid rows.
        self.attn_bias = torch.zeros(max_num_reqs, n + 1, n + 1, dtype=torch.float32, device=device)
        self.tree_parents = (torch.arange(max_num_tokens, dtype=torch.int32, device=device) % (n + 1)) - 1
        self._bias_rows = 0  # rows of attn_bias holding a tree mask
        # Hybrid targets: the accepted-token count the recurrent layers resume
        # from next step, per request of the step just compacted.
        self._resume: torch.Tensor | None = None  # has_drafts of the step compacted
        _RUNTIME = self
        logger.info("DDTree: budget %d nodes, drafter depth %d.", budget, depth)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)

    def forget_tables(self) -> None:
        """Drop the layer tables: the runner calls this when it allocates its caches (again), so a
        table never holds on to, or points into, caches that were replaced."""
        self._tables.clear()

    def _table(self, kind: str, caches: list[tuple[int, torch.Tensor]]):
        """``ddtree_moves``' table of these caches (None: move them with torch indexing), made
        once: the caches are vLLM's persistent tensors, known here by their addresses."""
        if not self._move_kernels or not caches:
            return None
        key = (kind, *((g, c.data_ptr()) for g, c in caches))
        if key not in self._tables:
            if kind == "kv":
                table = ddtree_moves.kv_table([c for _g, c in caches])
            elif kind == "state":
                table = ddtree_moves.state_table(caches)
            else:
                table = ddtree_moves.window_table(caches)
            self._tables[key] = table
        return self._tables[key]

    # ------------------------------------------------------------------
    # Drafting: logits -> trees
    # ------------------------------------------------------------------
    def build(
        self, draft_logits: torch.Tensor, req_ids: list[str], drafted: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``draft_logits [R, D, V]`` -> draft token ids ``[R, N]`` in node order.

        ``drafted`` (``[R]`` bool, from ``limit_draft_blocks``): False for a
        request whose drafter block did not fit; its tokens are verified as
        rejected next step. The trees of requests this step left out (the
        scheduler skipped them, their drafts wait) are kept, up to one batch of
        them, so that such a request is verified against its own tree when it
        comes back; finished requests are no longer among them
        (``forget_requests``)."""
        trees = build_trees(draft_logits, self.budget)
        num_reqs = draft_logits.shape[0]
        index = {rid: i for i, rid in enumerate(req_ids[:num_reqs])}
        tokens, parent, depth, mask = trees.tokens, trees.parent, trees.depth, trees.ancestor_mask
        if drafted is None:
            drafted = torch.ones(num_reqs, dtype=torch.bool, device=parent.device)
        old = self._stored
        if old is not None:
            waiting = [(rid, i) for rid, i in old.req_index.items() if rid not in index]
            waiting = waiting[: self.attn_bias.shape[0]]
            if waiting:
                # From pinned memory, not blocking: a copy from pageable memory makes the host wait
                # for the GPU queue (here, the drafter's work) before it can prepare the next step.
                rows = torch.tensor([i for _, i in waiting])
                if parent.device.type == "cuda":
                    rows = rows.pin_memory()
                rows = rows.to(parent.device, non_blocking=True)
                tokens = torch.cat([tokens, old.tokens.index_select(0, rows)])
                drafted = torch.cat([drafted, old.drafted.index_select(0, rows)])
                parent = torch.cat([parent, old.parent.index_select(0, rows)])
                depth = torch.cat([depth, old.depth.index_select(0, rows)])
                mask = torch.cat([mask, old.ancestor_mask.index_select(0, rows)])
                for rid, _ in waiting:
                    index[rid] = len(index)
        self._stored = _StoredTrees(
            req_index=index, tokens=tokens, drafted=drafted, parent=parent, depth=depth, ancestor_mask=mask
        )
        return trees.tokens

    def limit_draft_blocks(
        self,
        query_positions: torch.Tensor,
        query_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        max_model_len: int,
    ) -> torch.Tensor:
        """Keep the drafter inside max_model_len, request by request.

        ``query_positions`` / ``query_slots`` ``[R, 1 + depth]``: the DFlash
        drafter's query block of each request (its bonus token, then ``depth``
        mask tokens), as vLLM's input kernel wrote them; ``seq_lens [R]`` the
        drafter's sequence lengths (context + block). A request whose last
        block position is not below ``max_model_len`` would read rotary tables
        and write KV slots past its end: its block moves to positions
        ``0 .. depth`` of its own cache, its KV writes are skipped (vLLM's
        padding slot) and it attends only to that block. Its drafts are then
        meaningless and ``build`` marks them so. Other requests are untouched,
        so one request near the end no longer stops drafting for the batch.
        Returns ``[R]`` bool: the requests whose block fits. In place, no host
        sync."""
        block = query_positions.shape[1]
        fits = query_positions[:, -1] < max_model_len
        off = ~fits.view(-1, 1)
        query_positions.copy_(torch.where(off, self._node_ids[:block].to(query_positions.dtype), query_positions))
        query_slots.masked_fill_(off, _PADDING_SLOT)
        seq_lens.copy_(torch.where(fits, seq_lens, torch.full_like(seq_lens, block)))
        return fits

    def forget_trees(self) -> None:
        """Drafting was skipped: the next step's drafts (if any) carry no tree."""
        self._stored = None

    def forget_requests(self, req_ids) -> None:
        """These requests finished: drop their stored trees. The runner calls this with the
        scheduler's finished request ids, so ``build`` carries (and copies to the device) only
        the trees of requests that are really waiting, never those of requests that are gone.
        Only the index entries go; the other requests' rows stay where they are."""
        if self._stored is not None:
            for rid in req_ids:
                self._stored.req_index.pop(rid, None)

    # ------------------------------------------------------------------
    # Verification: positions and attention bias
    # ------------------------------------------------------------------
    def prepare_step(
        self,
        req_ids: list[str],
        num_draft_tokens: list[int],
        query_start_loc: torch.Tensor,
        num_computed_tokens: torch.Tensor,
        req_indices: torch.Tensor,
        query_pos: torch.Tensor,
        positions: torch.Tensor,
        mrope_positions: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        from_last_step: list[bool] | None = None,
    ) -> None:
        """Give draft tokens depth-based positions and set the per-request bias.

        ``from_last_step`` (async scheduling): which requests were in the last
        step, the only ones whose drafts vLLM scattered in from that step's
        trees. The others (the scheduler skipped them for a step) carry
        placeholders: their stored tree's tokens are written into
        ``input_ids`` (the runner's buffer) at their draft rows, so they are
        verified against their own tree.

        ``positions`` (the runner's buffer, already used for slot mapping) is
        updated in place for the tokens of requests with drafts, and so is
        ``mrope_positions`` ``[3, tokens]`` for M-RoPE targets (decode tokens
        are text: the three rows move together). Each token's parent row is
        published for the recurrent layers.
        """
        n = self.budget
        num_reqs = len(num_draft_tokens)
        device = self.device
        stored = self._stored
        rows = [-1] * num_reqs
        if stored is not None:
            rows = [stored.req_index.get(rid, -1) for rid in req_ids[:num_reqs]]
        n_draft_cpu = torch.tensor(num_draft_tokens, dtype=torch.int64)
        rows_cpu = torch.tensor(rows, dtype=torch.int64)
        has_drafts_cpu = n_draft_cpu > 0
        has_tree_cpu = has_drafts_cpu & (rows_cpu >= 0)
        restore_cpu = torch.zeros(num_reqs, dtype=torch.bool)
        if from_last_step is not None:
            restore_cpu = has_tree_cpu & ~torch.tensor(from_last_step[:num_reqs], dtype=torch.bool)
        if bool((has_drafts_cpu & ~has_tree_cpu).any()):
            self._warn_once(
                "no-tree",
                "DDTree: some requests carry draft tokens without a tree; "
                "they are verified as rejected (no speed-up, output unchanged).",
            )
        # The host facts in one copy, from pinned memory where there is a GPU:
        # a copy from pageable memory may make the host wait for the stream.
        host = torch.stack([n_draft_cpu, has_tree_cpu.long(), rows_cpu.clamp(min=0), restore_cpu.long()])
        if device.type == "cuda":
            host = host.pin_memory()
        facts = host.to(device, non_blocking=True)
        n_draft, has_tree, idx, restore = facts[0], facts[1].bool(), facts[2], facts[3].bool()
        has_drafts = n_draft > 0
        if stored is not None:
            # A request whose drafter block did not fit has tokens but no tree.
            has_tree = has_tree & stored.drafted.index_select(0, idx)

        parent = self._star_parent.expand(num_reqs, n).clone()
        depth = self._star_depth.expand(num_reqs, n).clone()
        mask = self._star_mask.expand(num_reqs, n + 1, n + 1).clone()
        if stored is not None and bool(has_tree_cpu.any()):
            sel = has_tree.view(-1, 1)
            parent = torch.where(sel, stored.parent.index_select(0, idx), parent)
            depth = torch.where(sel, stored.depth.index_select(0, idx), depth)
            mask = torch.where(sel.view(-1, 1, 1), stored.ancestor_mask.index_select(0, idx), mask)

        if stored is not None and bool(restore_cpu.any()):
            if input_ids is None:
                raise RuntimeError("DDTree: prepare_step needs input_ids to restore the drafts of skipped requests")
            self._restore_drafts(input_ids, stored.tokens.index_select(0, idx), restore, n_draft, query_start_loc)

        # Positions: root + depth for the draft tokens of requests with drafts.
        total = req_indices.shape[0]
        qpos = query_pos[:total].to(torch.int64)
        tok_has = has_drafts[req_indices] & (qpos > 0) & (qpos <= n)
        node = (qpos - 1).clamp(0, n - 1)
        tok_depth = depth[req_indices, node]
        seq_positions = positions[:total].clone()
        new_pos = num_computed_tokens[req_indices].to(torch.int64) + torch.where(tok_has, tok_depth, qpos)
        seq_mrope = None
        if mrope_positions is not None:
            seq_mrope = mrope_positions[:, :total].clone()
            mrope_positions[:, :total] += (new_pos - seq_positions.to(torch.int64)).to(mrope_positions.dtype)
        positions[:total] = new_pos
        # Parent rows: a node's parent node + 1 (the root's children: row 0);
        # other tokens continue the row before them, as in a chain.
        tok_parent = torch.where(tok_has, parent[req_indices, node] + 1, qpos - 1)
        if total > self.tree_parents.shape[0] or num_reqs > self.attn_bias.shape[0]:
            raise RuntimeError(
                f"DDTree: a step of {num_reqs} requests / {total} tokens exceeds the "
                f"buffers sized for {self.attn_bias.shape[0]} / {self.tree_parents.shape[0]}"
            )
        self.tree_parents[:total].copy_(tok_parent)

        # Bias rows: 0 where attention is allowed; requests without drafts
        # (decodes of one token, short prefills) stay causal.
        allowed = mask | ~has_drafts.view(-1, 1, 1)
        bias = self.attn_bias[:num_reqs]
        bias.zero_()
        bias.masked_fill_(~allowed, float("-inf"))
        if self._bias_rows > num_reqs:
            self.attn_bias[num_reqs : self._bias_rows].zero_()
        self._bias_rows = num_reqs

        self._step = _StepTrees(
            num_reqs=num_reqs,
            has_drafts=has_drafts,
            has_tree=has_tree,
            num_drafts=n_draft,
            query_start=query_start_loc[:num_reqs].to(torch.int64),
            parent=parent,
            depth=depth,
            ancestor_mask=mask,
            seq_positions=seq_positions,
            seq_mrope_positions=seq_mrope,
        )

    def _restore_drafts(
        self,
        input_ids: torch.Tensor,
        tokens: torch.Tensor,
        restore: torch.Tensor,
        num_drafts: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> None:
        """Write each restored request's tree tokens (``tokens [num_reqs, N]``)
        into its draft rows (``query_start + 1 + node``, as many as it was given).
        Entries that write nothing rewrite their request's root row with its own
        token: no draft row is a root row, and every value is read before the
        write, so the scatter has no conflicting writes and no host sync."""
        num_reqs = tokens.shape[0]
        start = query_start_loc[:num_reqs].to(torch.int64).view(-1, 1)
        node = self._node_ids[1:].view(1, -1)  # [1, N]: node j's row is start + 1 + j
        write = restore.view(-1, 1) & (node <= num_drafts.view(-1, 1))
        rows = torch.where(write, start + node, start).view(-1)
        values = torch.where(write, tokens.to(input_ids.dtype), input_ids[start.expand_as(write)])
        input_ids.scatter_(0, rows, values.view(-1))

    def end_forward(self) -> None:
        """A forward without drafts follows: its short queries (one-token
        decodes, prefill chunks of at most N+1 tokens) are read with the bias
        too, so the tree rows go back to all-allowed."""
        if self._bias_rows:
            self.attn_bias[: self._bias_rows].zero_()
            self._bias_rows = 0

    # ------------------------------------------------------------------
    # Memory
    # ------------------------------------------------------------------
    def profile_step_memory(
        self,
        hidden_states: torch.Tensor,
        compute_logits,
        scheduled_tokens: int,
        captured_layers: int,
    ) -> None:
        """Hold a tree step's largest tensors inside vLLM's memory profile (the
        runner's ``profile_run``, after its dummy forward and sampling), so the
        peak that sizes the KV cache sees them.

        vLLM's profile samples one row per request and frees the target's
        captured hidden states after its dummy forward. A tree step holds, at
        once: those captured states (``captured_bytes_per_token``), the
        target's logits at every request's root and nodes (up to
        ``max_num_reqs x (budget + 1)`` rows, at most ``scheduled_tokens``, the
        most the scheduler puts in one step), the float32 temporaries of
        sampling ``_CHOICE_ROWS`` of them at a time with top-k, top-p and
        allowed-token masks, and the drafter's logits at every depth of every
        request (the tree build's input). Not held here: the drafter's context
        work (its ``fc`` output and the context K/V it precomputes), which a
        step does beside the captured states and the verification logits but
        after the sampling temporaries are freed; the ``gpu_memory_utilization``
        headroom outside vLLM's budget covers what it adds. ``hidden_states``:
        the dummy forward's ``[tokens, hidden]``; ``compute_logits``: the
        target's."""
        reqs = self.max_num_reqs
        rows = min(scheduled_tokens, reqs * (self.budget + 1), hidden_states.shape[0])
        device = hidden_states.device
        hidden = hidden_states.shape[-1]
        per_token = captured_bytes_per_token(captured_layers, hidden, hidden_states.dtype)
        captured = torch.empty(scheduled_tokens * per_token, dtype=torch.uint8, device=device)
        verify = compute_logits(torch.rand_like(hidden_states[:rows]))
        vocab = verify.shape[-1]
        row_req = (torch.arange(rows, device=device) // (self.budget + 1)).clamp(max=reqs - 1)
        sampling = _ProfileSampling(
            temperature=torch.full((reqs,), 0.5, device=device),
            top_k=torch.full((reqs,), vocab - 1, dtype=torch.int64, device=device),
            top_p=torch.full((reqs,), 0.9, device=device),
            allowed_token_ids_mask=torch.zeros(reqs, vocab, dtype=torch.bool, device=device),
        )
        self._target_choices(verify, row_req, sampling)
        draft_hidden = torch.rand(reqs * self.depth, hidden, dtype=hidden_states.dtype, device=device)
        draft = compute_logits(draft_hidden)
        build_trees(draft.view(reqs, self.depth, -1), self.budget)
        logger.info(
            "DDTree: the memory profile holds a tree step of %d verified rows, %d draft rows "
            "(vocabulary %d) and %d tokens' hidden states captured at %d layers.",
            rows,
            reqs * self.depth,
            vocab,
            scheduled_tokens,
            captured_layers,
        )
        del captured

    # ------------------------------------------------------------------
    # Acceptance
    # ------------------------------------------------------------------
    def _target_choices(self, logits: torch.Tensor, row_req: torch.Tensor, sampling_metadata) -> torch.Tensor:
        """The target's token at every row: argmax when greedy, else a sample of
        its temperature/top-k/top-p distribution. Rows go in chunks, so the
        float32 vocab-sized temporaries are those of ``_CHOICE_ROWS`` rows
        whatever batch x budget is (``profile_step_memory`` shows them to
        vLLM's memory profile). A greedy batch without allowed-token masks
        needs none: the argmax of the logits as they are is the argmax of
        their float32 copy (the conversion is exact), in one launch."""
        if sampling_metadata.all_greedy and sampling_metadata.allowed_token_ids_mask is None:
            return logits.argmax(dim=-1)
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        for lo in range(0, logits.shape[0], _CHOICE_ROWS):
            hi = min(lo + _CHOICE_ROWS, logits.shape[0])
            out[lo:hi] = self._choices(logits[lo:hi], row_req[lo:hi], sampling_metadata)
        return out

    def _choices(self, logits: torch.Tensor, row_req: torch.Tensor, sampling_metadata) -> torch.Tensor:
        raw = logits.float()
        if sampling_metadata.allowed_token_ids_mask is not None:
            # True marks a token the request does not allow (as the chain's sampler reads it).
            raw.masked_fill_(sampling_metadata.allowed_token_ids_mask[row_req], float("-inf"))
        greedy = raw.argmax(dim=-1)
        if sampling_metadata.all_greedy:
            return greedy
        temp = sampling_metadata.temperature[row_req].float()
        is_greedy = temp < _SAMPLING_EPS
        scaled = raw / torch.where(is_greedy, 1.0, temp).unsqueeze(-1)
        top_k = sampling_metadata.top_k
        top_p = sampling_metadata.top_p
        if top_k is not None or top_p is not None:
            scaled = apply_top_k_top_p(
                scaled,
                top_k[row_req] if top_k is not None else None,
                top_p[row_req] if top_p is not None else None,
            )
        probs = torch.softmax(scaled, dim=-1)
        race = torch.empty_like(probs).exponential_()
        sampled = (probs / race).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)

    def sample(
        self,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        num_draft_tokens: list[int],
        sampling_metadata,
    ) -> SamplerOutput:
        """Walk every request's tree; return accepted tokens + bonus, -1 padded."""
        step = self._step
        assert step is not None, "DDTree: sample() without prepare_step()"
        n = self.budget
        num_reqs = step.num_reqs
        device = logits.device
        # Each request's rows (its root, then its drafts), derived on the GPU:
        # the row count is known on the host, so no copy and no wait.
        counts = step.num_drafts + 1
        rows = sum(num_draft_tokens) + num_reqs
        row_req = torch.repeat_interleave(torch.arange(num_reqs, device=device), counts, output_size=rows)
        choices = self._target_choices(logits, row_req, sampling_metadata)

        # [root] + nodes layout per request, -1 past the request's drafts.
        starts = torch.cumsum(counts, 0) - counts
        entry = self._node_ids.view(1, -1)  # [1, N+1]
        valid = entry <= step.num_drafts.view(-1, 1)
        flat = (starts.view(-1, 1) + entry).clamp(max=choices.shape[0] - 1)
        target_tokens = torch.where(valid, choices[flat], -1)

        tok_idx = (step.query_start.view(-1, 1) + entry[:, 1:]).clamp(max=input_ids.shape[0] - 1)
        # Requests without a stored tree verify nothing (no node can match).
        node_valid = valid[:, 1:] & step.has_tree.view(-1, 1)
        tree_tokens = torch.where(node_valid, input_ids[tok_idx].to(torch.int64), -1)

        tree = DDTree(
            tokens=tree_tokens,
            depth=step.depth,
            parent=step.parent,
            scores=torch.zeros(num_reqs, n, device=device),
            ancestor_mask=step.ancestor_mask,
            position_offsets=torch.cat([torch.zeros_like(step.depth[:, :1]), step.depth], dim=1),
            num_depths=self.depth,
        )
        walk = walk_trees(tree, target_tokens)
        step.accepted_nodes = walk.accepted_nodes
        step.num_accepted = walk.num_accepted

        out = torch.full((num_reqs, n + 1), -1, dtype=torch.int32, device=device)
        acc = walk.accepted_nodes  # [R, D]
        acc_tokens = tree_tokens.gather(1, acc.clamp(min=0))
        d = acc.shape[1]
        out[:, :d] = torch.where(acc >= 0, acc_tokens, -1).to(torch.int32)
        out.scatter_(1, walk.num_accepted.view(-1, 1), walk.bonus_tokens.view(-1, 1).to(torch.int32))
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    # ------------------------------------------------------------------
    # Compaction of the accepted path
    # ------------------------------------------------------------------
    def compact(
        self,
        kv_groups: list[tuple[torch.Tensor, list[torch.Tensor]]],
        row_tensors: list[torch.Tensor],
        positions: torch.Tensor,
        mrope_positions: torch.Tensor | None = None,
        recurrent: list[RecurrentGroup] | None = None,
    ) -> None:
        """Move the accepted nodes (rows query_start + node + 1) to the path's
        consecutive rows (query_start + depth) in the target KV caches
        (``kv_groups``: each KV-cache group's slot mapping and caches) and in
        ``row_tensors`` (hidden states, input ids).

        ``positions`` gets the plain sequence positions back: the accepted
        path's depth-based positions are exactly those, and the rejected rows
        then point past the accepted path (as in a chain), where the drafter's
        next block overwrites them instead of colliding with accepted slots.
        """
        step = self._step
        self._step = None
        self._resume = None
        if step is None or step.accepted_nodes is None:
            return
        positions[: step.seq_positions.shape[0]] = step.seq_positions
        if mrope_positions is not None and step.seq_mrope_positions is not None:
            mrope_positions[:, : step.seq_mrope_positions.shape[1]] = step.seq_mrope_positions
        if recurrent:
            self._commit_recurrent(step, recurrent)
        src, dst = self._moves(step)
        for slot_mapping, kv_caches in kv_groups:
            if not kv_caches:
                continue
            table = self._table("kv", [(0, c) for c in kv_caches])
            if table is not None:
                ddtree_moves.move_kv(table, slot_mapping, src, dst, step.num_reqs)
                continue
            src_slots = slot_mapping[src].to(torch.int64)
            dst_slots = slot_mapping[dst].to(torch.int64)
            block = kv_caches[0].shape[2]
            src_at = (src_slots // block, src_slots % block)
            dst_at = (dst_slots // block, dst_slots % block)
            for cache in kv_caches:
                cache[:, dst_at[0], dst_at[1]] = cache[:, src_at[0], src_at[1]]
        for t in row_tensors:
            t[dst] = t[src]

    @staticmethod
    def _moves(step: _StepTrees) -> tuple[torch.Tensor, torch.Tensor]:
        """Source and destination rows ``[R * D]`` of the accepted path's moves.

        The shape is fixed (no host read of how many nodes moved, so the host
        never waits for the target's forward here and queues the drafter
        behind it). An entry that does not move copies its request's root row
        onto itself: no move ever writes a root row, so these no-op copies
        cannot collide with a real move, and every read happens before any
        write (an accepted node's row can be another node's destination).
        """
        acc = step.accepted_nodes  # [R, D] node indices, -1 padded
        assert acc is not None
        d = acc.shape[1]
        depth_rows = torch.arange(1, d + 1, device=acc.device).view(1, -1)
        qs = step.query_start.view(-1, 1)
        move = (acc >= 0) & (acc + 1 != depth_rows)
        src = torch.where(move, qs + acc + 1, qs).view(-1)
        dst = torch.where(move, qs + depth_rows, qs).view(-1)
        return src, dst

    # ------------------------------------------------------------------
    # Hybrid targets: commit the accepted path's recurrent state
    # ------------------------------------------------------------------
    def _commit_recurrent(self, step: _StepTrees, groups: list[RecurrentGroup]) -> None:
        """Commit the last accepted node's recurrent state where the next step reads it.

        Every verified row ``j`` left its recurrent state in slot ``j`` and its
        input at conv-window entry ``width - 2 + j`` (history below). The next
        step reads slot 0 and entries ``0 .. width - 2`` when the runner's
        accepted-token count is 1, and so does a step that schedules the
        request without drafts (vLLM's non-spec path always does). So the last
        accepted row ``r`` is copied into slot 0 and its window (its ancestors'
        inputs, then its own) into the first entries. Rows without drafts are
        left alone; a request that accepted nothing (``r == 0``) is already in
        place.
        """
        num_reqs = step.num_reqs
        acc = step.accepted_nodes
        num = step.num_accepted
        assert acc is not None and num is not None
        last_node = acc.gather(1, (num - 1).clamp(min=0).view(-1, 1)).view(-1)
        last_row = torch.where((num > 0) & step.has_tree, last_node + 1, 0)
        self._resume = step.has_drafts
        entries: dict[int, torch.Tensor] = {}  # width -> [R, width - 1] window entries to keep
        firsts, lasts = [], []
        for group in groups:
            if group.width not in entries:
                entries[group.width] = self._window_entries(step, last_row, group.width)
            slots = group.state_slots[:num_reqs].to(torch.int64)
            firsts.append(slots[:, 0])
            lasts.append(slots.gather(1, torch.where(step.has_drafts, last_row, 0).view(-1, 1)).view(-1))
        windows = [(g, conv) for g, group in enumerate(groups) for conv in group.conv_states]
        states = [(g, ssm) for g, group in enumerate(groups) for ssm in group.ssm_states]
        window_table = self._table("window", windows)
        state_table = self._table("state", states)
        kernels = (
            self._move_kernels
            and len(entries) == 1
            and (window_table is not None or not windows)
            and (state_table is not None or not states)
        )
        if kernels:
            first_slots = torch.stack(firsts)  # [groups, R]; slot 0 is also the conv line
            if window_table is not None:
                ddtree_moves.gather_windows(window_table, first_slots, next(iter(entries.values())))
            if state_table is not None:
                ddtree_moves.copy_states(state_table, first_slots, torch.stack(lasts))
            return
        for group, first, last in zip(groups, firsts, lasts, strict=True):
            src_t = entries[group.width]
            dst_t = torch.arange(group.width - 1, device=src_t.device).expand_as(src_t)
            lines = first.view(-1, 1).expand_as(src_t)
            for conv in group.conv_states:
                conv[lines, :, dst_t] = conv[lines, :, src_t]
            for ssm in group.ssm_states:
                ssm[first] = ssm[last]

    @staticmethod
    def _window_entries(step: _StepTrees, last_row: torch.Tensor, width: int) -> torch.Tensor:
        """``[R, width - 1]``: the convolution-window entries, oldest first, that hold the inputs
        of the last accepted row's ancestors and its own (entry ``width - 2 + j`` holds row
        ``j``'s input, the entries below it the history before the step). Requests without
        drafts keep their window: entries ``0 .. width - 2``."""
        val = width - 2  # entry of row 0
        cur = val + last_row
        src = [cur]
        for _k in range(1, width - 1):
            is_row = cur > val
            row = (cur - val).clamp(min=1)
            parent_row = step.parent.gather(1, (row - 1).view(-1, 1)).view(-1) + 1
            cur = torch.where(is_row, val + parent_row, cur - 1)
            src.append(cur)
        src_t = torch.stack(src[::-1], 1)  # oldest first
        dst_t = torch.arange(width - 1, device=src_t.device).expand_as(src_t)
        return torch.where(step.has_drafts.view(-1, 1), src_t, dst_t)

    def resume_recurrent_state(self, num_accepted_tokens: torch.Tensor) -> None:
        """After the runner counted accepted tokens: requests verified this step
        resume from their first slot, where ``compact`` committed the path."""
        has_drafts = self._resume
        self._resume = None
        if has_drafts is None:
            return
        n = min(has_drafts.shape[0], num_accepted_tokens.shape[0])
        counts = num_accepted_tokens[:n]
        counts.copy_(torch.where(has_drafts[:n], torch.ones_like(counts), counts))
