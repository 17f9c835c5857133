#!/usr/bin/env python3
"""Test double for the inference engines (SGLang and vLLM) on lab nodes that have no GPU.

It speaks the small part of the OpenAI-compatible HTTP API that the deployment checks
(/health, /v1/models, /v1/completions with and without `stream: true` server-sent events,
/metrics, /version), parses the engine's own command line, and, while it runs, "holds" the fake GPUs by writing a holder file that the fake
nvidia-smi adds to its memory.used, so waiting for the GPUs to be free is tested for real.

    inference_server.py sglang --model-path DIR ...        plays `python -m sglang.launch_server`
    inference_server.py vllm serve MODEL_DIR ...           plays vLLM's console script
    vllm serve MODEL_DIR ...                               the same, through a link named `vllm`

As vLLM it refuses what vLLM 0.20.1 refuses (a model directory without config.json, a bad
--speculative-config, a drafter directory or its config.json missing, draft slots that leave the
scheduler no tokens) and also more speculative tokens than the drafter's block holds
(N > block_size - 1), which real vLLM runs with silently degraded acceptance. How many
batched-token slots a sequence reserves for drafting is the DDTree engine's base descriptor's rule
(ddtree/vllm-<release>/base.json "scheduler", read by module_utils/ddtree_base.py): on a lab node
tests/lab/labctl.py copies both beside this file (ddtree_base.py, ddtree/vllm-<release>/base.json);
run from a checkout, they are the repository's own. The stand-in plays the release of the one base
there is. /metrics carries vLLM's spec-decode counters under their real
names. The API key comes from --api-key or VLLM_API_KEY and guards /v1/* only, as in vLLM.

Speed: generation takes time the way a memory-bound decoder's does. Every target step lasts
TARGET_STEP_S (longer by BATCH_STEP_COST per other request in flight) and yields the bonus token plus
the accepted share of the engine's speculative tokens: vLLM's --speculative-config
num_speculative_tokens, SGLang's --speculative-num-steps (MTP). So the same prompt runs at different
speeds on the two engines, from their own command lines, and the low_acceptance knob slows vLLM.

Measured figures (the lab's default, written by tests/lab/labctl.py from the results of record
through ddtree/trained/decision.py --replay): /etc/lab-fakes/measured-figures.json holds, per method
(chain, ddtree15/32/64), temperature (greedy, sampled) and batch (1, 8), a trained pair's measured
mean acceptance length and the measured ms per verification step at Qwen3.6-27B's shapes. vLLM then
serves each method at its measured length (tokens per target step) and at TARGET_STEP_S x its step
cost over the chain's at that batch, for the request's temperature (0: greedy) and the batch in
flight (up to 4 requests: batch 1's figures, more: batch 8's); a figure not measured is taken from
the other batch, then the other temperature. The chain is "dflash", a budget "ddtree-<budget>"; a
method the file lacks (or a knob below that sets its speed) falls back to the knobs' model.

Failure knobs, read at start from /etc/lab-fakes/engine-knobs.json: top-level keys apply to every
engine, a section named after the engine ("vllm", "sglang") overrides them for that engine only:
    {"vllm": {"never_healthy": true}}   /health answers 503 forever
    {"vllm": {"die_at_start": true}}    exits 1 before serving (systemd sees a failed start)
    {"vllm": {"low_acceptance": true}}  drafts are almost never accepted (mean length about 1.1)
    {"vllm": {"slow_start_s": 20}}      /health answers 503 for that many seconds first
Speed knobs (roles/tune measures them; any of them set for an engine turns the measured figures off
for it): `accept_share`, the share of the speculative tokens a draft
gets accepted (default 0.35), `step_cost`, how many times longer a target step takes (default
1.0; a DDTree step verifies more tokens and costs more), and `batch_step_cost`, how much longer a
step gets per other request in flight (default 0.08; a DDTree step verifies concurrency x (budget +
1) tokens, so under load its step grows faster than the chain's and a budget that wins alone loses). A "methods" section inside the engine's
section overrides any knob for one speculative method, named as roles/tune names its candidates
("dflash", "ddtree-<budget>"), so one node can favour the chain and another a tree, or make one
budget fail:
    {"vllm": {"methods": {"ddtree-32": {"accept_share": 0.6, "step_cost": 1.2},
                          "ddtree-64": {"die_at_start": true}}}}

Standard library only: lab nodes have nothing but Debian's python3.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HOLDERS_DIR = Path(os.environ.get("LAB_FAKES_HOLDERS", "/run/lab-fakes/gpu-holders"))
# The base descriptors' reader and the folder of vllm-<release>/base.json: beside this file on a lab
# node (tests/lab/labctl.py copies them there), the checkout's own otherwise (see engine_rules).
HERE = Path(__file__).resolve().parent
READER_MODULE = "lab_stand_in_ddtree_base"
KNOBS_FILE = Path(os.environ.get("LAB_FAKES_KNOBS", "/etc/lab-fakes/engine-knobs.json"))
MEASURED_FILE = Path(os.environ.get("LAB_FAKES_MEASURED", "/etc/lab-fakes/measured-figures.json"))
# What one H200 of the captured fixtures has (143771 MiB) times SGLang's default
# --mem-fraction-static 0.88: the order of what a serving engine really holds.
HELD_MIB_PER_GPU = 126518
# One target step reads the weights once: Qwen3.6-27B's ~55.6 GB of bf16 over an H200's ~4.8 TB/s.
TARGET_STEP_S = 0.0116
# Decode is memory-bound: each other request in the same batch makes a step only this much longer.
BATCH_STEP_COST = 0.08
# Prefill of a short prompt: one step plus this per prompt word.
PREFILL_S_PER_WORD = 0.0002
# The stand-in's longest completion, whatever max_tokens asks.
MAX_COMPLETION_TOKENS = 256


class Refusal(Exception):
    """The engine would refuse to start with this command line; the message is what it prints."""


@dataclass
class Engine:
    """What one engine process serves; subclasses parse their engine's command line."""

    name: str
    model_path: str
    served_name: str
    host: str
    port: int
    gpus: list[int]
    api_key: str | None = None
    counters: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    max_model_len: int | None = None
    speculative_raw: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0
    step_s: float = TARGET_STEP_S
    batch_step_cost: float = BATCH_STEP_COST

    def check(self) -> None:
        if not Path(self.model_path, "config.json").is_file():
            raise Refusal(f"model path {self.model_path} has no config.json")

    def metrics(self) -> str:
        return ""

    def on_completion(self, tokens: int, per_step: float | None = None) -> None:
        self.counters["generation_tokens"] = self.counters.get("generation_tokens", 0) + tokens

    def speculative_tokens(self) -> int:
        """Draft tokens the engine proposes per target step (0: no speculation)."""
        return 0

    def accepted_share(self) -> float:
        return HEALTHY_ACCEPT_SHARE

    def tokens_per_step(self) -> float:
        """The bonus token plus the accepted part of the draft."""
        n = self.speculative_tokens()
        return 1.0 + max(0.0, min(float(n), self.accepted_share() * n))

    def speed(self, temperature: float, batch: int) -> tuple[float, float]:
        """(tokens per target step, seconds per step) for a request at this temperature and batch."""
        return self.tokens_per_step(), self.step_s

    def generate(self, prompt: str, max_tokens: int, temperature: float = 0.0) -> Iterator[tuple[str, int]]:
        """(text, tokens) per target step, each after the step's time; the counters move at the end.

        Each step ends at a deadline counted from the request's start, not a sleep after the last
        chunk went out: as on a GPU, the host's time to wake up and write a chunk overlaps the next
        step instead of adding to it, so a busy lab host (a 2-core machine running the controller
        and other work) does not change the speeds the knobs set (roles/tune compares them to 5%)."""
        words = completion_words(prompt, max_tokens)
        with self.lock:
            self.in_flight += 1
            per_step, step_s = self.speed(temperature, self.in_flight)
        try:
            deadline = time.monotonic() + step_s + PREFILL_S_PER_WORD * len(prompt.split())
            time.sleep(max(0.0, deadline - time.monotonic()))
            done, step = 0, 0
            while done < len(words):
                with self.lock:
                    others = self.in_flight - 1
                deadline += step_s * (1 + self.batch_step_cost * others)
                time.sleep(max(0.0, deadline - time.monotonic()))
                step += 1
                upto = min(len(words), max(done + 1, round(step * per_step)))
                yield " " + " ".join(words[done:upto]), upto - done
                done = upto
        finally:
            with self.lock:
                self.in_flight -= 1
                self.on_completion(len(words), per_step)


class SGLang(Engine):
    mtp_steps: int = 0

    @classmethod
    def from_argv(cls, argv: list[str]) -> SGLang:
        p = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
        p.add_argument("--model-path", required=True)
        p.add_argument("--served-model-name")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=30000)
        p.add_argument("--tp-size", type=int, default=1)
        p.add_argument("--api-key")
        # Accepted so the unit can carry Qwen's real MTP command line unchanged.
        for flag in (
            "--speculative-algo",
            "--speculative-num-steps",
            "--speculative-eagle-topk",
            "--speculative-num-draft-tokens",
            "--mem-fraction-static",
            "--context-length",
            "--mamba-radix-cache-strategy",
            "--reasoning-parser",
        ):
            p.add_argument(flag)
        a = p.parse_args(argv)
        engine = cls(
            name="sglang",
            model_path=a.model_path,
            served_name=a.served_model_name or a.model_path,
            host=a.host,
            port=a.port,
            gpus=list(range(a.tp_size)),
            api_key=a.api_key or os.environ.get("SGLANG_API_KEY"),
        )
        if a.speculative_algo and a.speculative_num_steps:
            try:
                engine.mtp_steps = int(a.speculative_num_steps)
            except ValueError:
                raise Refusal(f"--speculative-num-steps must be an integer, not {a.speculative_num_steps!r}") from None
        return engine

    def speculative_tokens(self) -> int:
        return self.mtp_steps

    def metrics(self) -> str:
        tokens = self.counters.get("generation_tokens", 0)
        return f'sglang:generation_tokens_total{{model_name="{self.served_name}"}} {tokens}\n'


# What the stand-in drafter gets accepted per draft, as a share of the speculative tokens: a
# healthy DFlash drafter on Qwen3.6-27B lands around 35%; a misconfigured one (e.g. vLLM 0.20's
# layer offset) almost never gets a draft past the first position.
HEALTHY_ACCEPT_SHARE = 0.35
LOW_ACCEPT_SHARE = 0.004
# --speculative-config keys vLLM 0.20.1 accepts for draft-model methods (ddtree_budget: with the
# project's DDTree patch, method "ddtree" only).
SPEC_KEYS = {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "ddtree_budget"}
SPEC_METHODS = {"dflash", "ddtree", "eagle", "eagle3", "mtp", "ngram", "draft_model"}
DRAFTER_METHODS = {"dflash", "ddtree", "eagle", "eagle3", "draft_model"}


def drafter_block_size(config: dict) -> int | None:
    """block_size at the top level (older drafters) or inside dflash_config (newer)."""
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    value = config.get("block_size", dflash.get("block_size"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_speculative_config(raw: str, tp: int) -> dict:
    """Validate --speculative-config the way vLLM does, plus the block-size bound vLLM lacks."""
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as e:
        raise Refusal(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise Refusal(f"--speculative-config must be a JSON object, not {type(spec).__name__}")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise Refusal(f"--speculative-config: unexpected keyword(s) {', '.join(unknown)}")
    method = spec.get("method")
    if method not in SPEC_METHODS:
        raise Refusal(f"--speculative-config: method {method!r} is not one of {', '.join(sorted(SPEC_METHODS))}")
    if "ddtree_budget" in spec and method != "ddtree":
        raise Refusal("--speculative-config: ddtree_budget is only valid with method 'ddtree'")
    budget = spec.get("ddtree_budget")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise Refusal(f"--speculative-config: ddtree_budget must be a positive integer, not {budget!r}")
    n = spec.get("num_speculative_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise Refusal(f"--speculative-config: num_speculative_tokens must be a positive integer, not {n!r}")
    draft_tp = spec.get("draft_tensor_parallel_size", 1)
    if draft_tp not in (1, tp):
        raise Refusal(f"--speculative-config: draft_tensor_parallel_size must be 1 or {tp}, not {draft_tp!r}")
    if method in DRAFTER_METHODS:
        model = spec.get("model")
        if not isinstance(model, str) or not model:
            raise Refusal(f"--speculative-config: method {method} needs 'model', the drafter directory")
        if not Path(model).is_dir():
            raise Refusal(f"drafter model directory {model} does not exist")
        cfg_path = Path(model, "config.json")
        if not cfg_path.is_file():
            raise Refusal(f"drafter model directory {model} has no config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise Refusal(f"drafter config {cfg_path} cannot be read: {e}") from None
        block = drafter_block_size(cfg) if isinstance(cfg, dict) else None
        if block is not None and n > block - 1:
            raise Refusal(
                f"num_speculative_tokens {n} exceeds the drafter's block (block_size {block}): at most {block - 1}"
            )
    return spec


def engine_rules():
    """The rules (module_utils/ddtree_base.py BaseRules) of the one DDTree base beside HERE or in the checkout.

    A Refusal naming the file when the reader or the descriptor is missing or broken, or there is
    not exactly one base (the stand-in plays one release).
    """
    node, checkout = HERE / "ddtree_base.py", HERE.parents[1] / "module_utils" / "ddtree_base.py"
    if node.is_file():
        reader, home = node, HERE / "ddtree"
    elif checkout.is_file():
        reader, home = checkout, HERE.parents[1] / "ddtree"
    else:
        raise Refusal(
            f"{node} is missing: the stand-in reads the DDTree base's rules with it; tests/lab/labctl.py puts it "
            "there when it makes the node (make the node again)"
        )
    spec = importlib.util.spec_from_file_location(READER_MODULE, reader)
    base = importlib.util.module_from_spec(spec)
    sys.modules[READER_MODULE] = base  # its dataclasses look their module up there
    spec.loader.exec_module(base)
    try:
        return base.load_rules(home)
    except base.BaseError as e:
        raise Refusal(f"the stand-in cannot read the DDTree base's rules: {e}") from None


class VLLM(Engine):
    """`vllm serve MODEL ...` as the unit renders it."""

    speculative: dict | None = None
    accept_share: float = HEALTHY_ACCEPT_SHARE
    # The measured figures for this engine's method and the chain's (see load_replay); None: the knobs' model.
    replay: dict | None = None
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192

    @classmethod
    def from_argv(cls, argv: list[str]) -> VLLM:
        if not argv or argv[0] != "serve":
            raise Refusal("usage: vllm serve MODEL [options]; the stand-in plays only 'serve'")
        p = argparse.ArgumentParser(prog="vllm serve", allow_abbrev=False)
        p.add_argument("model")
        p.add_argument("--host")
        p.add_argument("--port", type=int, default=8000)
        p.add_argument("--served-model-name", nargs="+")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        p.add_argument("--max-model-len", type=int)
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        p.add_argument("--speculative-config")
        p.add_argument("--compilation-config", "-cc")
        p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
        p.add_argument("--api-key", nargs="+")
        p.add_argument("--max-num-batched-tokens", type=int)
        p.add_argument("--max-num-seqs", type=int)
        p.add_argument("--attention-backend")
        p.add_argument("--reasoning-parser")
        p.add_argument("--dtype")
        for flag in ("--language-model-only", "--trust-remote-code", "--enforce-eager", "--disable-log-requests"):
            p.add_argument(flag, action="store_true")
        a = p.parse_args(argv[1:])
        if a.compilation_config is not None:
            try:
                compilation = json.loads(a.compilation_config)
            except ValueError:
                compilation = None
            if not isinstance(compilation, dict):
                raise Refusal(f"--compilation-config must be a JSON object, not {a.compilation_config!r}")
        if not 0 < a.gpu_memory_utilization <= 1:
            raise Refusal(f"--gpu-memory-utilization must be in (0, 1], not {a.gpu_memory_utilization}")
        engine = cls(
            name="vllm",
            model_path=a.model,
            served_name=(a.served_model_name or [a.model])[0],
            host=a.host or "0.0.0.0",
            port=a.port,
            gpus=list(range(a.tensor_parallel_size)),
            api_key=(a.api_key or [os.environ.get("VLLM_API_KEY") or ""])[0] or None,
        )
        engine.max_model_len = a.max_model_len
        engine.speculative_raw = a.speculative_config
        # vLLM's `serve` defaults on GPUs of 70 GB and more (the lab's fixtures are H200s).
        engine.max_num_seqs = a.max_num_seqs or 1024
        engine.max_num_batched_tokens = a.max_num_batched_tokens or 8192
        return engine

    def check(self) -> None:
        super().check()
        cfg = json.loads(Path(self.model_path, "config.json").read_text())
        text = cfg.get("text_config", cfg)
        limit = text.get("max_position_embeddings")
        if self.max_model_len and isinstance(limit, int) and self.max_model_len > limit:
            raise Refusal(f"--max-model-len {self.max_model_len} exceeds the model's max_position_embeddings {limit}")
        if self.speculative_raw is not None:
            self.speculative = parse_speculative_config(self.speculative_raw, len(self.gpus))
            spec = self.speculative
            # vLLM (VllmConfig._set_max_num_scheduled_tokens): DFlash drafts in parallel and reserves
            # batched-token slots per sequence for it, as many as the base's rule says for the tokens
            # verified per step.
            verified = int(spec.get("ddtree_budget") or spec["num_speculative_tokens"])
            left = self.max_num_batched_tokens - engine_rules().draft_slots(verified) * self.max_num_seqs
            if left <= 0:
                raise Refusal(
                    f"max_num_scheduled_tokens is set to {left} based on the speculative decoding settings,"
                    " which does not allow any tokens to be scheduled. Increase max_num_batched_tokens to"
                    " accommodate the additional draft token slots, or decrease num_speculative_tokens or"
                    " max_num_seqs."
                )

    def speculative_tokens(self) -> int:
        return int(self.speculative["num_speculative_tokens"]) if self.speculative else 0

    def method_name(self) -> str:
        """The speculative method as roles/tune names its candidates: 'dflash', 'ddtree-<budget>' ('' without)."""
        if not self.speculative:
            return ""
        method = str(self.speculative["method"])
        if method == "ddtree":
            return f"ddtree-{self.speculative.get('ddtree_budget') or self.speculative['num_speculative_tokens']}"
        return method

    def accepted_share(self) -> float:
        return self.accept_share

    def speed(self, temperature: float, batch: int) -> tuple[float, float]:
        if not self.replay:
            return super().speed(temperature, batch)
        length, ratio = replay_cell(self.replay, temperature, batch)
        return length, TARGET_STEP_S * ratio

    def on_completion(self, tokens: int, per_step: float | None = None) -> None:
        super().on_completion(tokens, per_step)
        if not self.speculative:
            return
        n = int(self.speculative["num_speculative_tokens"])
        # Every step proposes one draft of n tokens; the target keeps the accepted ones plus a bonus.
        accepted_per_draft = self.accept_share * n if per_step is None else per_step - 1.0
        per_draft = max(0.0, min(float(n), accepted_per_draft))
        drafts = max(1, -(-tokens * 1000 // int((1 + per_draft) * 1000)))
        accepted = max(0, min(tokens - drafts, drafts * n))
        c = self.counters
        c["drafts"] = c.get("drafts", 0) + drafts
        c["draft_tokens"] = c.get("draft_tokens", 0) + drafts * n
        c["accepted"] = c.get("accepted", 0) + accepted
        base, extra = divmod(accepted, drafts)
        for d in range(drafts):
            for pos in range(min(n, base + (1 if d < extra else 0))):
                c[f"pos{pos}"] = c.get(f"pos{pos}", 0) + 1

    def metrics(self) -> str:
        labels = f'model_name="{self.served_name}",engine="0"'
        c = self.counters
        lines: list[str] = []

        def counter(name: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"])
            for extra, value in samples:
                lines.append(f"{name}_total{{{labels}{extra}}} {float(value)}")
            for extra, _ in samples:
                lines.append(f"{name}_created{{{labels}{extra}}} {self.started}")

        counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", [("", c.get("generation_tokens", 0))]
        )
        if self.speculative:
            n = int(self.speculative["num_speculative_tokens"])
            counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", [("", c.get("drafts", 0))])
            counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", [("", c.get("draft_tokens", 0))])
            counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", [("", c.get("accepted", 0))])
            counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [(f',position="{i}"', c.get(f"pos{i}", 0)) for i in range(n)],
            )
        return "\n".join(lines) + "\n"


ENGINES: dict[str, type[Engine]] = {"sglang": SGLang, "vllm": VLLM}


def load_knobs(engine: str) -> dict:
    """Failure knobs a test sets on a node: top-level ones, overridden by the engine's own section."""
    try:
        raw = json.loads(KNOBS_FILE.read_text())
    except FileNotFoundError:
        return {}
    knobs = {k: v for k, v in raw.items() if k not in ENGINES}
    knobs.update(raw.get(engine) or {})
    return knobs


# The speed knobs: any of them in force for an engine turns the measured figures off for it.
SPEED_KNOBS = ("accept_share", "low_acceptance", "step_cost", "batch_step_cost")


def replay_method(method_name: str) -> str:
    """roles/tune's candidate name ('dflash', 'ddtree-32') as ddtree/trained/decision.py names it."""
    return "chain" if method_name == "dflash" else method_name.replace("-", "")


def load_replay(method_name: str) -> dict | None:
    """{"method": cells, "chain": cells} from MEASURED_FILE, or None (no file, or the method is not in it)."""
    try:
        methods = json.loads(MEASURED_FILE.read_text())["methods"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    cells = methods.get(replay_method(method_name)) if method_name else None
    if not isinstance(cells, dict):
        return None
    return {"method": cells, "chain": methods.get("chain") or {}}


def replay_cell(replay: dict, temperature: float, batch: int) -> tuple[float, float]:
    """(mean acceptance length, step cost over the chain's) of the nearest measured cell.

    The request's own temperature and batch first, then the other batch, then the other temperature.
    """
    kinds = ["sampled", "greedy"] if temperature > 0 else ["greedy", "sampled"]
    batches = ["1", "8"] if batch <= 4 else ["8", "1"]
    for kind in kinds:
        for b in batches:
            cell = (replay["method"].get(kind) or {}).get(b) or {}
            length, ms = cell.get("mean_acceptance_length"), cell.get("ms_per_step")
            if not length:
                continue
            chain_ms = ((replay["chain"].get(kind) or {}).get(b) or {}).get("ms_per_step")
            return float(length), (float(ms) / float(chain_ms)) if ms and chain_ms else 1.0
    return 1.0, 1.0


def apply_knobs(engine: Engine, knobs: dict) -> dict:
    """Set the engine's speed from the knobs; returns the knobs in force for its speculative method.

    A "methods" entry named like the engine's method ("dflash", "ddtree-32") overrides the others.
    """
    knobs = dict(knobs)
    methods = knobs.pop("methods", None)
    if isinstance(engine, VLLM) and isinstance(methods, dict):
        knobs.update(methods.get(engine.method_name()) or {})
    if isinstance(engine, VLLM):
        if "accept_share" in knobs:
            engine.accept_share = float(knobs["accept_share"])
        if knobs.get("low_acceptance"):
            engine.accept_share = LOW_ACCEPT_SHARE
        if not any(k in knobs for k in SPEED_KNOBS):
            engine.replay = load_replay(engine.method_name())
    engine.step_s = TARGET_STEP_S * float(knobs.get("step_cost", 1.0))
    engine.batch_step_cost = float(knobs.get("batch_step_cost", BATCH_STEP_COST))
    return knobs


def completion_words(prompt: str, max_tokens: int) -> list[str]:
    """A deterministic, non-empty continuation, one word per token: the same prompt, the same text."""
    words = [w for w in prompt.split() if w] or ["token"]
    return [words[i % len(words)] for i in range(max(1, min(max_tokens, MAX_COMPLETION_TOKENS)))]


class Holder:
    """The holder file that makes the fake nvidia-smi report this process's GPU memory."""

    def __init__(self, engine: Engine) -> None:
        self.path = HOLDERS_DIR / f"{engine.name}-{os.getpid()}.json"
        self.body = {"pid": os.getpid(), "gpus": engine.gpus, "mib": HELD_MIB_PER_GPU, "name": engine.name}

    def __enter__(self) -> Holder:
        HOLDERS_DIR.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.body))
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)


class Server(ThreadingHTTPServer):
    """The HTTP server, with the listen backlog of vLLM's (uvicorn's default, 2048).

    socketserver's default of 5 is fewer than the requests roles/tune sends at once: while a busy
    host keeps the accept loop from running, the kernel drops the connections beyond it and each
    of those clients waits for TCP's one-second SYN retransmit, which the benchmark counts as the
    engine's time (a chain measured 18% slow at 8 requests, enough to flip a ranking).
    """

    request_queue_size = 2048


def make_handler(engine: Engine, ready: threading.Event):
    class Handler(BaseHTTPRequestHandler):
        server_version = f"lab-fake-{engine.name}"
        disable_nagle_algorithm = True  # as the engines' servers do: each streamed chunk leaves at once

        def log_message(self, fmt: str, *args: object) -> None:
            sys.stderr.write(f"{self.command} {self.path} -> {args[1] if len(args) > 1 else ''}\n")

        def _send(self, code: int, body: str | dict, ctype: str = "application/json") -> None:
            data = (json.dumps(body) if isinstance(body, dict) else body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            if not engine.api_key or self.path in ("/health", "/metrics", "/version"):
                return True
            if self.headers.get("Authorization") == f"Bearer {engine.api_key}":
                return True
            self._send(401, {"error": {"message": "invalid API key"}})
            return False

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200 if ready.is_set() else 503, "" if ready.is_set() else "loading", "text/plain")
            elif not ready.is_set():
                self._send(503, {"error": {"message": "model is loading"}})
            elif not self._authorised():
                return
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": engine.served_name, "object": "model"}]})
            elif self.path == "/metrics":
                self._send(200, engine.metrics(), "text/plain; version=0.0.4")
            elif self.path == "/version":
                self._send(200, {"version": f"lab-fake-{engine.name}"})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            if not ready.is_set():
                self._send(503, {"error": {"message": "model is loading"}})
                return
            if not self._authorised():
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                req = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError:
                self._send(400, {"error": {"message": "body is not JSON"}})
                return
            if self.path != "/v1/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            try:
                temperature = float(req.get("temperature", 1.0))
            except (TypeError, ValueError):
                temperature = 1.0
            steps = engine.generate(str(req.get("prompt", "")), int(req.get("max_tokens", 16)), temperature)
            if req.get("stream"):
                self._stream(steps, bool((req.get("stream_options") or {}).get("include_usage")))
                return
            parts = list(steps)
            n = sum(tokens for _, tokens in parts)
            self._send(
                200,
                {
                    "object": "text_completion",
                    "model": engine.served_name,
                    "choices": [{"index": 0, "text": "".join(t for t, _ in parts), "finish_reason": "length"}],
                    "usage": {"completion_tokens": n},
                },
            )

        def _stream(self, steps: Iterator[tuple[str, int]], include_usage: bool) -> None:
            """Server-sent events as vLLM sends them: one chunk per step, usage last when asked, [DONE]."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def event(body: dict | str) -> None:
                data = body if isinstance(body, str) else json.dumps(body)
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()

            n = 0
            for text, tokens in steps:
                n += tokens
                choice = {"index": 0, "text": text, "finish_reason": None}
                event({"object": "text_completion", "model": engine.served_name, "choices": [choice]})
            last = {"index": 0, "text": "", "finish_reason": "length"}
            event({"object": "text_completion", "model": engine.served_name, "choices": [last]})
            if include_usage:
                event(
                    {
                        "object": "text_completion",
                        "model": engine.served_name,
                        "choices": [],
                        "usage": {"completion_tokens": n},
                    }
                )
            event("[DONE]")

    return Handler


def main(argv: list[str], prog: str = "inference_server.py") -> int:
    if Path(prog).name == "vllm":  # run through a link named like vLLM's console script
        argv = ["vllm", *argv]
    if not argv or argv[0] not in ENGINES:
        print(f"usage: inference_server.py {{{','.join(ENGINES)}}} ENGINE-ARGS...", file=sys.stderr)
        return 2
    knobs = load_knobs(argv[0])
    try:
        engine = ENGINES[argv[0]].from_argv(argv[1:])
        engine.check()
    except Refusal as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    knobs = apply_knobs(engine, knobs)
    if knobs.get("die_at_start"):
        print("error: engine died during start (knob die_at_start)", file=sys.stderr)
        return 1
    ready = threading.Event()
    server = Server((engine.host, engine.port), make_handler(engine, ready))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    with Holder(engine):

        def load() -> None:
            time.sleep(float(knobs.get("slow_start_s", 0.5)))
            if not knobs.get("never_healthy"):
                ready.set()

        threading.Thread(target=load, daemon=True).start()
        print(f"{engine.name} stand-in serving {engine.served_name} on {engine.host}:{engine.port}", flush=True)
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], sys.argv[0]))
