#!/usr/bin/env python3
"""Gated DeltaNet verification at Qwen3.6-27B's shape: vLLM 0.20.1's spec-decode kernel beside replay.

Stock (``fused_sigmoid_gating_delta_rule_update`` as the GDN layer calls it on the speculative path:
one state slot per verified token, ``num_accepted_tokens``, in-place final states; with the change set
applied a tree passes ``parent_rows``) writes one recurrent state per verified token. Replay
(ddtree/common/gdn_replay.py) reads each request's committed state once, writes the outputs, and then
commits the accepted tokens: ``verify`` + ``commit`` is what it costs a step.

Per case (batch, method): first the outputs and the committed state are compared with stock's (max
error; a chain is expected bit for bit, ``bit_identical``), then both are timed replayed from CUDA
graphs over several layers' caches, as verify_parts.py does. The shapes and layer counts are
verify_parts.py's.

    python3 -m ddtree.bench.gdn_verify --plan                    # the cases, no GPU needed
    python3 -m ddtree.bench.gdn_verify --out /tmp/gdn.json       # needs a GPU and vLLM 0.20.1

Methods: ``chain`` (16 tokens a request: the chain of 15 drafts) and ``ddtree<budget>`` (a random tree
of budget + 1 rows). A tree is timed on stock only where the change set is applied (``parent_rows``).
"""

from __future__ import annotations

import argparse
import inspect
import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ddtree import HOME
from ddtree.bench.verify_parts import GDN, LAYERS, SHAPES, random_parents, time_graph

CHAIN_TOKENS = 16  # the chain of 15 drafts and its root
METHODS = ("chain", "ddtree16", "ddtree32", "ddtree64")
TREE_SHAPES = ("random", "fan")


@dataclass(frozen=True)
class Case:
    batch: int
    method: str
    rows: int  # verified tokens per request
    tree: str | None  # parent shape (verify_parts.random_parents), None for the chain


def parse_list(text: str, allowed: tuple[str, ...] | None, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{what} is empty; give a comma-separated list")
    bad = [t for t in items if allowed is not None and t not in allowed]
    if bad:
        raise ValueError(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed or ())})")
    return items


def parse_batches(text: str) -> list[int]:
    out = []
    for t in parse_list(text, None, "batches"):
        if not t.isdigit() or int(t) < 1:
            raise ValueError(f"batch {t!r} is not a whole number of requests (1 or more)")
        out.append(int(t))
    return out


def plan(batches: list[int], methods: list[str], tree_shapes: list[str]) -> list[Case]:
    cases = []
    for batch in batches:
        for method in methods:
            if method == "chain":
                cases.append(Case(batch, method, CHAIN_TOKENS, None))
            else:
                rows = int(method.removeprefix("ddtree")) + 1
                cases.extend(Case(batch, method, rows, shape) for shape in tree_shapes)
    return cases


def ancestors(parents: list[int], i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def load_replay():
    """ddtree/common/gdn_replay.py (an added module of the engine, not part of vLLM 0.20.1)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gdn_replay", HOME / "common/gdn_replay.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class GdnVerifyCase:
    def __init__(self, case: Case, state_dtype: torch.dtype, dtype: torch.dtype, gen: torch.Generator, gr):
        from vllm.model_executor.layers.fla.ops.fused_sigmoid_gating import fused_sigmoid_gating_delta_rule_update

        self.stock_fn = fused_sigmoid_gating_delta_rule_update
        self.has_tree = "parent_rows" in inspect.signature(fused_sigmoid_gating_delta_rule_update).parameters
        self.gr, self.case = gr, case
        dev = "cuda"
        h, hv, d = GDN["key_heads"], GDN["value_heads"], GDN["head"]
        batch, q = case.batch, case.rows
        n = batch * q
        rand = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype)  # noqa: E731
        # Stock: 1 + batch * q slots a layer, request r's row t in slot 1 + r * q + t; the committed
        # state in its row 0. Replay: the same caches, request r's committed state in slot 1 + r * q.
        self.ssm = [torch.randn(1 + n, hv, d, d, device=dev).mul_(0.05).to(state_dtype) for _ in range(LAYERS)]
        self.q, self.k = rand(1, n, h, d), rand(1, n, h, d)
        self.v = rand(1, n, hv, d)
        self.A_log = torch.randn(hv, device=dev)
        self.a, self.b = rand(n, hv), rand(n, hv)
        self.dt_bias = rand(hv)
        self.cu = (torch.arange(batch + 1, dtype=torch.int32) * q).to(dev)
        self.indices = torch.arange(1, 1 + n, dtype=torch.int32, device=dev).view(batch, q)
        self.slots = self.indices[:, 0].contiguous()
        self.ones = torch.ones(batch, dtype=torch.int32, device=dev)
        self.out = torch.empty(1, n, hv, d, device=dev, dtype=dtype)
        if case.tree is None:
            self.parents, self.paths, self.accepted_rows = None, None, None
            self.accepted = torch.full((batch,), q, dtype=torch.int32, device=dev)  # all accepted
            self.last = [q - 1] * batch
        else:
            parents = random_parents(batch, q, gen, case.tree)
            self.parents = parents.view(-1).to(dev)
            self.paths = gr.tree_paths(self.parents, self.cu, q)
            # Each request accepts the path to its last row (the deepest of a chain-like tree).
            paths = [ancestors(parents[r].tolist(), q - 1) for r in range(batch)]
            width = max(len(p) for p in paths)
            table = torch.zeros(batch, width, dtype=torch.int32)
            for r, p in enumerate(paths):
                table[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
            self.accepted_rows = table.to(dev)
            self.accepted = torch.tensor([len(p) for p in paths], dtype=torch.int32, device=dev)
            self.last = [q - 1] * batch

    def stock(self, layer: int) -> torch.Tensor:
        kw = {"parent_rows": self.parents} if self.parents is not None else {}
        out, _ = self.stock_fn(
            A_log=self.A_log,
            a=self.a,
            b=self.b,
            dt_bias=self.dt_bias,
            q=self.q,
            k=self.k,
            v=self.v,
            initial_state=self.ssm[layer],
            inplace_final_state=True,
            cu_seqlens=self.cu,
            ssm_state_indices=self.indices,
            num_accepted_tokens=self.ones,
            use_qk_l2norm_in_kernel=True,
            **kw,
        )
        return out

    def verify(self, layer: int) -> torch.Tensor:
        kw = dict(parent_rows=self.parents, paths=self.paths) if self.parents is not None else {}
        return self.gr.gdn_verify(
            self.A_log, self.a, self.b, self.dt_bias, self.q, self.k, self.v, self.ssm[layer], self.cu, self.slots,
            out=self.out, **kw,
        )  # fmt: skip

    def commit(self, layer: int) -> None:
        self.gr.gdn_commit(
            self.A_log, self.a, self.b, self.dt_bias, self.k, self.v, self.ssm[layer], self.cu, self.slots,
            self.accepted, accepted_rows=self.accepted_rows,
        )  # fmt: skip

    def check(self) -> dict[str, Any]:
        """Stock and replay from the same committed states: outputs and the state after the accepted tokens."""
        start = self.ssm[0].clone()
        stock_out = self.stock(0).clone()
        stock_states = self.ssm[0].clone()
        self.ssm[0].copy_(start)
        out = self.verify(0).clone()
        self.commit(0)
        committed = self.ssm[0][self.slots.long()].float()
        last = torch.tensor(self.last, device=self.indices.device)
        want = stock_states[self.indices.gather(1, last[:, None])[:, 0].long()].float()
        self.ssm[0].copy_(start)
        return {
            "out_max_err": float((out.float() - stock_out.float()).abs().max()),
            "state_max_err": float((committed - want).abs().max()),
            "bit_identical": bool(torch.equal(out, stock_out) and torch.equal(committed, want)),
        }

    def run(self) -> dict[str, Any]:
        row: dict[str, Any] = {}
        stock_ok = self.parents is None or self.has_tree
        if stock_ok:
            row.update(self.check())
            row["stock"] = time_graph(lambda: [self.stock(i) for i in range(LAYERS)])
        row["verify"] = time_graph(lambda: [self.verify(i) for i in range(LAYERS)])
        row["commit"] = time_graph(lambda: [self.commit(i) for i in range(LAYERS)])
        row["replay"] = time_graph(lambda: [(self.verify(i), self.commit(i)) for i in range(LAYERS)])
        if stock_ok:
            row["ratio"] = round(row["replay"] / row["stock"], 3)
        return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python3 -m ddtree.bench.gdn_verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--plan", action="store_true", help="print the cases as JSON and stop (no GPU needed)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)}")
    ap.add_argument("--trees", default="random", help=f"tree shapes, of {', '.join(TREE_SHAPES)}")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument(
        "--state-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the recurrent state cache: float32 as Qwen3.6-27B's mamba_ssm_dtype, bfloat16 as a config without it",
    )
    a = ap.parse_args(argv)
    try:
        a.cases = plan(
            parse_batches(a.batches),
            parse_list(a.methods, METHODS, "methods"),
            parse_list(a.trees, TREE_SHAPES, "trees"),
        )
    except ValueError as e:
        ap.error(str(e))
    if not a.plan and not a.out:
        ap.error("give --out FILE for the results (or --plan to list the cases)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.plan:
        print(json.dumps([asdict(c) for c in a.cases], indent=1))
        return 0
    layers = SHAPES["27b"]["gdn_layers"]
    gr = load_replay()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)  # the trees
    rows = []
    for case in a.cases:
        row: dict[str, Any] = dict(asdict(case), dtype=a.dtype, state_dtype=a.state_dtype)
        row.update(GdnVerifyCase(case, getattr(torch, a.state_dtype), getattr(torch, a.dtype), gen, gr).run())
        row["step_ms"] = {k: round(row[k] * layers, 3) for k in ("stock", "replay") if k in row}
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    result = {"hardware": torch.cuda.get_device_name(), "gdn": GDN, "gdn_layers": layers, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
