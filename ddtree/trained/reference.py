"""DDTree in plain PyTorch on a trained pair, independent of vLLM and of the change set.

The drafter runs as ``ddtree.trained.models.Drafter`` (the weights the engine loads, computed in
float32); the tree is DDTree's best-first heap over the factorised draft distribution (per depth the
top-k log-probabilities, k = min(budget, vocab); pop the best prefix, push its next sibling and its
first child; stop after ``budget`` pops); verification is the target on HF transformers:

- pure-attention target: one forward over the context, the root and every tree node under an
  ancestor-only mask (a node sees the context, its ancestors and itself) at positions
  ``root + depth``, then the greedy walk from the root;
- Gated DeltaNet hybrid: a recurrent state cannot be masked, so each node's target token is the
  target's greedy continuation along the node's own path. At temperature 0 a node is accepted
  exactly when its path is a prefix of the target's greedy continuation, so the walk follows that
  continuation through the tree.

``simulate`` runs the whole decode as the engine does (prefill gives the first token; every step
drafts a block anchored at the last token, verifies, accepts ``k`` nodes and a bonus token) and
returns the accepted count of every step, which the GPU proof compares with the engine's.
"""

from __future__ import annotations

import heapq
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree.trained import models


@dataclass(frozen=True)
class Node:
    token: int
    depth: int  # 1 .. block - 1
    parent: int  # index into the tree's nodes; -1 is the root


def build_tree(logits: torch.Tensor, budget: int) -> list[Node]:
    """DDTree's tree of ``budget`` nodes from per-depth draft logits [depth, vocab], parents first."""
    logp = (logits.float() - logits.float().logsumexp(-1, keepdim=True)).cpu()
    k = min(budget, logp.shape[1])
    top_v, top_i = logp.topk(k, dim=-1)
    top_v, top_i = top_v.tolist(), top_i.tolist()
    depth_max = logp.shape[0]
    nodes: list[Node] = []
    # (-cumulative log-prob, insertion order, depth, rank, parent, parent's cumulative log-prob)
    heap = [(-top_v[0][0], 0, 1, 0, -1, 0.0)]
    order = 1
    while heap and len(nodes) < budget:
        neg, _, depth, rank, parent, base = heapq.heappop(heap)
        nodes.append(Node(top_i[depth - 1][rank], depth, parent))
        me, score = len(nodes) - 1, -neg
        if rank + 1 < k:
            heapq.heappush(heap, (-(base + top_v[depth - 1][rank + 1]), order, depth, rank + 1, parent, base))
            order += 1
        if depth < depth_max:
            heapq.heappush(heap, (-(score + top_v[depth][0]), order, depth + 1, 0, me, score))
            order += 1
    return nodes


def chain(logits: torch.Tensor) -> list[Node]:
    """The DFlash chain: the best token at every depth, one after the other."""
    return [Node(int(t), d + 1, d - 1) for d, t in enumerate(logits.argmax(-1).tolist())]


def walk(nodes: list[Node], choose) -> int:
    """Accepted nodes from the root: ``choose(i)`` is the target's token after node i (-1: the root)."""
    children: dict[int, dict[int, int]] = {}
    for i, n in enumerate(nodes):
        children.setdefault(n.parent, {}).setdefault(n.token, i)
    at, k = -1, 0
    while True:
        nxt = children.get(at, {}).get(choose(at))
        if nxt is None:
            return k
        at, k = nxt, k + 1


class Pair:
    """A trained pair loaded for the reference (float32 computation on the bf16 weights)."""

    def __init__(self, pair_dir: str, device: str = "cuda"):
        from safetensors.torch import load_file

        self.dir, self.device = pair_dir, torch.device(device)
        if self.device.type == "cuda":  # float32 means float32: no TF32 in matmuls or convolutions
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        info = json.loads(Path(pair_dir, "build.json").read_text())
        self.kind = info["kind"]
        self.lm, self.head, _ = models.load_target(self.kind, os.path.join(pair_dir, "target"), torch.bfloat16)
        self.lm, self.head = self.lm.float().to(self.device).eval(), self.head.float().to(self.device).eval()
        cfg = json.loads(Path(pair_dir, "drafter", "config.json").read_text())
        # What the engine reads: the config drafter_config wrote, not the training constants.
        self.layer_ids = list(cfg["dflash_config"]["target_layer_ids"])
        self.mask_id = int(cfg["dflash_config"]["mask_token_id"])
        self.block = int(cfg["block_size"])
        shape = models.DrafterShape(
            hidden=cfg["hidden_size"],
            taps=len(self.layer_ids),
            layer_types=tuple(cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]),
            window=int(cfg.get("sliding_window") or 0),
            heads=cfg["num_attention_heads"],
            kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            intermediate=cfg["intermediate_size"],
            rope_theta=float(cfg["rope_theta"]),
            eps=float(cfg["rms_norm_eps"]),
        )
        self.drafter = models.Drafter(shape)
        state = load_file(os.path.join(pair_dir, "drafter", "model.safetensors"))
        self.drafter.load_state_dict({k: v.float() for k, v in state.items()})
        self.drafter = self.drafter.to(self.device).eval()

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """The target's greedy continuation (n tokens) and the tapped states of prompt + continuation."""
        ids = torch.tensor([prompt], device=self.device)
        out = self.lm(ids, use_cache=True)
        cache, last = out.past_key_values, out.last_hidden_state[:, -1]
        toks = []
        for _ in range(n):
            nxt = self.head(last).argmax(-1)
            toks.append(int(nxt))
            out = self.lm(nxt[:, None], past_key_values=cache, use_cache=True)
            cache, last = out.past_key_values, out.last_hidden_state[:, -1]
        full = torch.tensor([prompt + toks], device=self.device)
        states = self.lm(full, output_hidden_states=True).hidden_states
        return toks, models.tapped_states(states, self.layer_ids)[0]

    @torch.no_grad()
    def draft_logits(self, taps: torch.Tensor, anchor_pos: int, anchor_token: int) -> torch.Tensor:
        """The drafter's logits for depths 1 .. block-1 of the block anchored at ``anchor_pos``."""
        block = torch.full((1, self.block), self.mask_id, device=self.device)
        block[0, 0] = anchor_token
        h = self.drafter(
            taps[None, :anchor_pos], torch.tensor([[anchor_pos]], device=self.device), self.lm.embed_tokens(block)
        )
        return self.head(h[0, 1:])

    @torch.no_grad()
    def tree_targets(self, context: list[int], nodes: list[Node]) -> list[int]:
        """The pure-attention target's greedy token after the root and after every node, in one
        forward under an ancestor-only mask (index 0: the root, i + 1: node i)."""
        n_ctx, n = len(context), len(nodes)
        ids = torch.tensor([context + [nd.token for nd in nodes]], device=self.device)
        pos = list(range(n_ctx)) + [n_ctx - 1 + nd.depth for nd in nodes]
        allowed = torch.ones(n_ctx + n, n_ctx + n, dtype=torch.bool, device=self.device).tril()
        allowed[n_ctx:, n_ctx:] = False
        for i in range(n):
            j = i
            while j >= 0:
                allowed[n_ctx + i, n_ctx + j] = True
                j = nodes[j].parent
        mask = torch.zeros(allowed.shape, device=self.device).masked_fill(~allowed, float("-inf"))
        out = self.lm(ids, attention_mask=mask[None, None], position_ids=torch.tensor([pos], device=self.device))
        return self.head(out.last_hidden_state[0, n_ctx - 1 :]).argmax(-1).tolist()

    @torch.no_grad()
    def taps_of(self, tokens: list[int]) -> torch.Tensor:
        """The tapped target states of a whole sequence (one forward)."""
        states = self.lm(torch.tensor([tokens], device=self.device), output_hidden_states=True).hidden_states
        return models.tapped_states(states, self.layer_ids)[0]

    def decisions(self, prompt: list[int], y: list[int], budgets: list[int | None]) -> dict:
        """At every anchor of the target's continuation ``y`` (the engine's step may start at any of
        them), each method's accepted count and the draft-score margins that decided it (``decide``)."""
        taps = self.taps_of(prompt + y)
        out: dict = {("chain" if b is None else f"ddtree{b}"): [] for b in budgets}
        for a in range(len(y) - 1):
            logits = self.draft_logits(taps, len(prompt) + a, y[a]).cpu()
            for b in budgets:
                out["chain" if b is None else f"ddtree{b}"].append(decide(logits, y[a + 1 :], b))
        return out

    def simulate(self, prompt: list[int], budgets: list[int | None], tokens: int, mask_verify: bool = False) -> dict:
        """Accepted nodes per step of a greedy decode of ``tokens`` tokens, per budget (None: the chain).

        The target's greedy continuation and the drafter's logits at each anchor are computed once and
        shared by every budget. With ``mask_verify`` (pure-attention targets) every step is also verified
        by ``tree_targets`` under the ancestor-only mask, and both walks must agree
        (``mask_walk_mismatch`` counts the steps where they did not)."""
        y, taps = self.greedy(prompt, tokens + self.block)
        p = len(prompt)
        drafts: dict[int, torch.Tensor] = {}
        out: dict = {"continuation": y[:tokens], "accepted_per_step": {}, "mask_walk_mismatch": {}}
        for budget in budgets:
            steps, i, mismatch = [], 0, 0
            while i + 1 < tokens:
                if i not in drafts:
                    drafts[i] = self.draft_logits(taps, p + i, y[i])
                nodes = chain(drafts[i]) if budget is None else build_tree(drafts[i], budget)
                at_i = i
                k = walk(nodes, lambda at, at_i=at_i, nodes=nodes: y[at_i + 1 + (0 if at < 0 else nodes[at].depth)])
                if mask_verify:
                    chosen = self.tree_targets(prompt + y[: i + 1], nodes)
                    if walk(nodes, lambda at, chosen=chosen: chosen[at + 1]) != k:
                        mismatch += 1
                steps.append(k)
                i += k + 1
            name = "chain" if budget is None else f"ddtree{budget}"
            out["accepted_per_step"][name] = steps
            out["mask_walk_mismatch"][name] = mismatch
        return out


def decide(logits: torch.Tensor, path: list[int], budget: int | None) -> dict:
    """The accepted count ``k`` at one anchor (``path``: the target's tokens after it) and the margins
    that decided it: ``inside[d]`` how far the path's node of depth d + 1 (d < k) was from leaving the
    tree, ``outside`` how far the node of depth k + 1 was from entering it (None past the drafter's
    depth or the known path). An engine whose drafter rounds differently (bf16 / fp16 against the
    reference's float32) can only accept another count where one of these margins is near zero."""
    logp = logits.float() - logits.float().logsumexp(-1, keepdim=True)
    depth = logits.shape[0]
    if budget is None:
        top2 = logp.topk(2, dim=-1)
        best, second = top2.values[:, 0], top2.values[:, 1]
        k = 0
        while k < min(depth, len(path)) and int(top2.indices[k, 0]) == path[k]:
            k += 1
        inside = [round(float(best[d] - second[d]), 5) for d in range(k)]
        outside = round(float(best[k] - logp[k, path[k]]), 5) if k < min(depth, len(path)) else None
        return {"k": k, "inside": inside, "outside": outside}
    nodes = build_tree(logits, budget + 1)
    score: list[float] = []
    for n in nodes:
        score.append((score[n.parent] if n.parent >= 0 else 0.0) + float(logp[n.depth - 1, n.token]))
    worst_kept, best_out = score[budget - 1], score[min(budget, len(score) - 1)]
    kept = nodes[:budget]
    k = walk(
        kept,
        lambda at: path[(0 if at < 0 else kept[at].depth)] if (0 if at < 0 else kept[at].depth) < len(path) else -1,
    )
    prefix = [
        float(logp[: d + 1].gather(1, torch.tensor(path[: d + 1])[:, None]).sum()) for d in range(min(depth, len(path)))
    ]
    inside = [round(prefix[d] - best_out, 5) for d in range(k)]
    outside = round(worst_kept - prefix[k], 5) if k < len(prefix) else None
    return {"k": k, "inside": inside, "outside": outside}
