"""The lab's stand-in vLLM refuses what the issue lists (so the swap's gates meet real refusals)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from ddtree.repo import repo_file

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("inference_server", REPO / "tests" / "fakes" / "inference_server.py")
fake = importlib.util.module_from_spec(_spec)
sys.modules["inference_server"] = fake
_spec.loader.exec_module(fake)


@pytest.fixture
def drafter(tmp_path) -> Path:
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"dflash_config": {"mask_token_id": 248070, "block_size": 16}}))
    return d


def engine(target: Path, *extra: str):
    e = fake.VLLM.from_argv(["serve", str(target), *extra])
    e.check()
    return e


def spec(**kw) -> str:
    return json.dumps(kw)


def test_parses_the_unit_command_line(target, drafter):
    e = engine(
        target,
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "Qwen3.6-27B",
        "--tensor-parallel-size",
        "2",
        "--speculative-config",
        spec(method="ddtree", model=str(drafter), num_speculative_tokens=15, ddtree_budget=64),
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "16384",
        "--no-enable-prefix-caching",
    )
    assert (e.served_name, e.port, e.gpus) == ("Qwen3.6-27B", 8000, [0, 1])
    assert (e.max_num_seqs, e.max_num_batched_tokens) == (32, 16384)
    assert e.speculative == {
        "method": "ddtree",
        "model": str(drafter),
        "num_speculative_tokens": 15,
        "ddtree_budget": 64,
    }


@pytest.mark.parametrize(
    ("make_spec", "message"),
    [
        (lambda d: '{"method": "dflash"', "--speculative-config is not valid JSON"),
        (lambda d: "[1]", "--speculative-config must be a JSON object, not list"),
        (lambda d: spec(method="medusa2", model=d, num_speculative_tokens=3), "method 'medusa2' is not one of"),
        (
            lambda d: spec(method="dflash", model=d, num_speculative_tokens=0),
            "num_speculative_tokens must be a positive",
        ),
        (lambda d: spec(method="dflash", model=d, num_speculative_tokens=16), "num_speculative_tokens 16 exceeds"),
        (lambda d: spec(method="dflash", model=d + "-x", num_speculative_tokens=3), "-x does not exist"),
        (lambda d: spec(method="dflash", num_speculative_tokens=3), "needs 'model', the drafter directory"),
        (lambda d: spec(method="dflash", model=d, num_speculative_tokens=3, ddtree_budget=8), "only valid with method"),
        (lambda d: spec(method="dflash", model=d, num_speculative_tokens=3, budget=8), "unexpected keyword(s) budget"),
    ],
)
def test_refuses_bad_speculative_configs(target, drafter, make_spec, message):
    with pytest.raises(fake.Refusal, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine(target, "--speculative-config", make_spec(str(drafter)))


def test_refuses_a_drafter_without_config_json(target, drafter):
    (drafter / "config.json").unlink()
    with pytest.raises(fake.Refusal, match=r"has no config\.json"):
        engine(target, "--speculative-config", spec(method="dflash", model=str(drafter), num_speculative_tokens=3))


def test_refuses_a_missing_target(tmp_path):
    with pytest.raises(fake.Refusal, match=r"has no config\.json"):
        engine(tmp_path / "nothing")


def test_refuses_a_context_longer_than_the_model(target):
    with pytest.raises(fake.Refusal, match="--max-model-len 300000 exceeds the model's max_position_embeddings 262144"):
        engine(target, "--max-model-len", "300000")


def test_refuses_draft_slots_that_leave_no_scheduled_tokens(target, drafter):
    # vLLM 0.20.1 with its serve defaults on a 70 GB+ GPU (1024 sequences, 8192 batched tokens):
    # DDTree budget 16 reserves 15 slots per sequence, 15360 in all.
    ddtree = spec(method="ddtree", model=str(drafter), num_speculative_tokens=7, ddtree_budget=16)
    with pytest.raises(fake.Refusal, match="max_num_scheduled_tokens is set to -7168 based on the speculative"):
        engine(target, "--speculative-config", ddtree)
    chain = spec(method="dflash", model=str(drafter), num_speculative_tokens=15)
    with pytest.raises(fake.Refusal, match="max_num_scheduled_tokens is set to -6144 based on the speculative"):
        engine(target, "--speculative-config", chain)
    # What service_swap renders by default: 32 sequences, 16384 batched tokens.
    e = engine(target, "--speculative-config", ddtree, "--max-num-seqs", "32", "--max-num-batched-tokens", "16384")
    assert e.speculative["ddtree_budget"] == 16
    with pytest.raises(fake.Refusal, match="is set to 0 based on"):
        engine(target, "--speculative-config", ddtree, "--max-num-seqs", "32", "--max-num-batched-tokens", "480")


def test_takes_a_compilation_config_object_and_refuses_anything_else(target):
    engine(target, "--compilation-config", '{"max_cudagraph_capture_size":1056}')
    with pytest.raises(fake.Refusal, match="--compilation-config must be a JSON object, not '1056'"):
        engine(target, "--compilation-config", "1056")
    with pytest.raises(fake.Refusal, match="must be a JSON object"):
        engine(target, "-cc", "{broken")


def test_knobs_per_engine(tmp_path, monkeypatch):
    knobs = tmp_path / "knobs.json"
    knobs.write_text(json.dumps({"slow_start_s": 2, "vllm": {"never_healthy": True}}))
    monkeypatch.setattr(fake, "KNOBS_FILE", knobs)
    assert fake.load_knobs("vllm") == {"slow_start_s": 2, "never_healthy": True}
    assert fake.load_knobs("sglang") == {"slow_start_s": 2}


def test_die_at_start_exits_1(tmp_path, target, monkeypatch, capsys):
    knobs = tmp_path / "knobs.json"
    knobs.write_text(json.dumps({"vllm": {"die_at_start": True}}))
    monkeypatch.setattr(fake, "KNOBS_FILE", knobs)
    assert fake.main(["serve", str(target)], "/opt/lab-fakes/vllm") == 1
    assert "engine died during start (knob die_at_start)" in capsys.readouterr().err


# The unit's scheduler limits (service_swap renders them): room for a budget of 64.
SCHEDULER = ("--max-num-seqs", "32", "--max-num-batched-tokens", "16384")


def test_method_names_match_the_tune_candidates(target, drafter):
    assert engine(target).method_name() == ""
    chain = engine(
        target, *SCHEDULER, "--speculative-config", spec(method="dflash", model=str(drafter), num_speculative_tokens=15)
    )
    assert chain.method_name() == "dflash"
    tree = spec(method="ddtree", model=str(drafter), num_speculative_tokens=15, ddtree_budget=32)
    assert engine(target, *SCHEDULER, "--speculative-config", tree).method_name() == "ddtree-32"
    depth = spec(method="ddtree", model=str(drafter), num_speculative_tokens=15)
    assert engine(target, *SCHEDULER, "--speculative-config", depth).method_name() == "ddtree-15"


def test_speed_knobs_per_method(target, drafter):
    knobs = {
        "step_cost": 2.0,
        "methods": {"ddtree-32": {"accept_share": 0.6, "step_cost": 1.25}, "ddtree-64": {"die_at_start": True}},
    }
    tree = engine(
        target,
        *SCHEDULER,
        "--speculative-config",
        spec(method="ddtree", model=str(drafter), num_speculative_tokens=15, ddtree_budget=32),
    )
    assert fake.apply_knobs(tree, knobs) == {"step_cost": 1.25, "accept_share": 0.6}
    assert tree.step_s == pytest.approx(0.0116 * 1.25)
    assert tree.tokens_per_step() == pytest.approx(1 + 0.6 * 15)
    chain = engine(
        target, *SCHEDULER, "--speculative-config", spec(method="dflash", model=str(drafter), num_speculative_tokens=15)
    )
    assert fake.apply_knobs(chain, knobs) == {"step_cost": 2.0}
    assert chain.step_s == pytest.approx(0.0116 * 2.0)
    assert chain.tokens_per_step() == pytest.approx(1 + 0.35 * 15)
    big = engine(
        target,
        *SCHEDULER,
        "--speculative-config",
        spec(method="ddtree", model=str(drafter), num_speculative_tokens=15, ddtree_budget=64),
    )
    assert fake.apply_knobs(big, knobs)["die_at_start"] is True


def _seconds_for(e, requests: int) -> float:
    """Wall time of ``requests`` completions of 48 tokens served at once by the stand-in."""
    import threading
    import time

    def one() -> None:
        for _ in e.generate("a short prompt", 48):
            pass

    threads = [threading.Thread(target=one) for _ in range(requests)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - start


def test_batch_step_cost_makes_a_method_slow_down_under_load(target, drafter):
    """A tree's step grows faster with the requests in flight than the chain's: its rank can flip with load."""
    tree = engine(
        target,
        *SCHEDULER,
        "--speculative-config",
        spec(method="ddtree", model=str(drafter), num_speculative_tokens=15, ddtree_budget=32),
    )
    knobs = {"methods": {"ddtree-32": {"accept_share": 0.35, "batch_step_cost": 0.6}}}
    assert fake.apply_knobs(tree, knobs) == {"accept_share": 0.35, "batch_step_cost": 0.6}
    assert (tree.batch_step_cost, tree.replay) == (0.6, None)
    chain = engine(
        target, *SCHEDULER, "--speculative-config", spec(method="dflash", model=str(drafter), num_speculative_tokens=15)
    )
    fake.apply_knobs(chain, {"methods": {"dflash": {"accept_share": 0.35}}})
    assert chain.batch_step_cost == 0.08
    # Alone both take the same steps; with 8 in flight each tree step is 1 + 0.6 x 7 = 5.2 steps long,
    # each chain step 1 + 0.08 x 7 = 1.56.
    assert _seconds_for(tree, 1) == pytest.approx(_seconds_for(chain, 1), rel=0.5)
    assert _seconds_for(tree, 8) > 2 * _seconds_for(chain, 8)


def test_accept_share_moves_the_acceptance_counters(target, drafter):
    e = engine(
        target, *SCHEDULER, "--speculative-config", spec(method="dflash", model=str(drafter), num_speculative_tokens=15)
    )
    fake.apply_knobs(e, {"methods": {"dflash": {"accept_share": 0.2}}})
    e.on_completion(400)
    # 1 + accepted / drafts: each draft keeps 0.2 x 15 = 3 tokens plus the bonus token
    assert 1 + e.counters["accepted"] / e.counters["drafts"] == pytest.approx(4.0, abs=0.05)


def test_a_method_knob_can_make_one_budget_die(tmp_path, target, drafter, monkeypatch, capsys):
    knobs = tmp_path / "knobs.json"
    knobs.write_text(json.dumps({"vllm": {"methods": {"ddtree-64": {"die_at_start": True}}}}))
    monkeypatch.setattr(fake, "KNOBS_FILE", knobs)
    tree = spec(method="ddtree", model=str(drafter), num_speculative_tokens=15, ddtree_budget=64)
    assert fake.main(["serve", str(target), *SCHEDULER, "--speculative-config", tree], "/opt/lab-fakes/vllm") == 1
    assert "engine died during start (knob die_at_start)" in capsys.readouterr().err


# The measured figures the lab replays, built as tests/lab/labctl.py builds them: from the results of
# record at the time the test runs, so a new build's figures are tested as they land.
def _replay_file(tmp_path) -> tuple[Path, list[dict]]:
    from ddtree.trained import decision

    summary = json.loads(repo_file("tests/lab/labctl.py").MEASURED_ACCEPTANCE.read_text())
    costs = decision.step_costs(decision.default_step_costs(), 512)
    path = tmp_path / "measured-figures.json"
    path.write_text(json.dumps(decision.replay(summary, costs)))
    return path, decision.table(summary, costs)


def _serving(target, drafter, budget: int | None):
    if budget is None:
        config = spec(method="dflash", model=str(drafter), num_speculative_tokens=15)
    else:
        config = spec(method="ddtree", model=str(drafter), num_speculative_tokens=15, ddtree_budget=budget)
    e = engine(target, *SCHEDULER, "--speculative-config", config)
    fake.apply_knobs(e, {})
    return e


def test_replays_the_measured_figures_as_the_decision_table_combines_them(tmp_path, target, drafter, monkeypatch):
    path, table = _replay_file(tmp_path)
    monkeypatch.setattr(fake, "MEASURED_FILE", path)
    chain = _serving(target, drafter, None)
    chain_tokens, chain_s = chain.speed(0.0, 1)
    compared = 0
    for row in table:
        if row["ddtree_over_chain"] is None or (row["temperature"], row["batch"]) != ("T=0", 1):
            continue
        tree = _serving(target, drafter, int(row["method"][6:]))
        tokens, step_s = tree.speed(0.0, 1)
        assert tokens == row["L"]
        # tokens/s over the chain's is the table's DDTree / chain
        assert (tokens / step_s) / (chain_tokens / chain_s) == pytest.approx(row["ddtree_over_chain"], abs=0.001)
        compared += 1
    assert compared >= 1
    # the counters vLLM's /metrics reports give the same mean acceptance length
    tree.on_completion(4000, tokens)
    assert 1 + tree.counters["accepted"] / tree.counters["drafts"] == pytest.approx(tokens, abs=0.01)


def test_a_figure_not_measured_is_the_nearest_measured_one(tmp_path, target, drafter, monkeypatch):
    path, _ = _replay_file(tmp_path)
    figures = json.loads(path.read_text())
    figures["methods"]["chain"]["sampled"] = {"1": {"mean_acceptance_length": None, "ms_per_step": 25.0}}
    figures["methods"]["ddtree32"]["greedy"]["8"] = {"mean_acceptance_length": 3.0, "ms_per_step": None}
    path.write_text(json.dumps(figures))
    monkeypatch.setattr(fake, "MEASURED_FILE", path)
    chain = _serving(target, drafter, None)
    assert chain.speed(0.7, 1) == chain.speed(0.0, 1)  # sampled not measured: greedy's
    tree = _serving(target, drafter, 32)
    greedy_8 = figures["methods"]["ddtree32"]["greedy"]["8"]
    # batch 8's length, and without a batch-8 step cost the chain's speed ratio of 1
    assert tree.speed(0.0, 8) == (greedy_8["mean_acceptance_length"], pytest.approx(0.0116))


def test_a_speed_knob_or_an_unknown_method_turns_the_figures_off(tmp_path, target, drafter, monkeypatch):
    path, _ = _replay_file(tmp_path)
    monkeypatch.setattr(fake, "MEASURED_FILE", path)
    tree = engine(
        target,
        *SCHEDULER,
        "--speculative-config",
        spec(method="ddtree", model=str(drafter), num_speculative_tokens=15, ddtree_budget=32),
    )
    fake.apply_knobs(tree, {"low_acceptance": True})
    assert tree.replay is None
    assert tree.speed(0.0, 1)[0] == pytest.approx(1 + 0.004 * 15)
    odd = _serving(target, drafter, 48)
    assert odd.replay is None


# The draft-slot rule is the DDTree base descriptor's ("scheduler" in ddtree/vllm-<release>/base.json),
# read with module_utils/ddtree_base.py: on a lab node both lie beside the stand-in, as labctl copies them.
def _node_fakes(tmp_path) -> Path:
    """/opt/lab-fakes as tests/lab/labctl.py lays it out: the stand-in, its `vllm` link, the bases' rules."""
    labctl = repo_file("tests/lab/labctl.py")
    fakes = tmp_path / "opt" / "lab-fakes"
    fakes.mkdir(parents=True)
    shutil.copy2(REPO / "tests" / "fakes" / "inference_server.py", fakes / "inference_server.py")
    (fakes / "vllm").symlink_to("inference_server.py")
    labctl.copy_engine_rules(fakes)
    return fakes


def _set_draft_rule(fakes: Path, plus: int) -> None:
    (descriptor,) = (fakes / "ddtree").glob("vllm-*/base.json")
    data = json.loads(descriptor.read_text())
    data["scheduler"]["draft_slots_per_sequence"]["verified_tokens_plus"] = plus
    descriptor.write_text(json.dumps(data))


def test_labctl_gives_the_node_the_deployed_base_and_the_reader(tmp_path):
    fakes = _node_fakes(tmp_path)
    assert (fakes / "ddtree_base.py").read_bytes() == (REPO / "module_utils" / "ddtree_base.py").read_bytes()
    copied = sorted(p.relative_to(fakes / "ddtree").as_posix() for p in (fakes / "ddtree").rglob("*") if p.is_file())
    assert copied == ["vllm-0.20.1/base.json"]
    assert (fakes / "ddtree/vllm-0.20.1/base.json").read_bytes() == (REPO / "ddtree/vllm-0.20.1/base.json").read_bytes()


def test_a_second_base_leaves_the_lab_node_with_the_deployed_release_s_base(tmp_path):
    """The lab deploys shared_settings_vllm_version; an engine with a second base gives its node that one only,
    so the stand-in still plays one release; a release without a base gets every base (the stand-in refuses
    then, naming them)."""
    labctl = repo_file("tests/lab/labctl.py")
    assert labctl.lab_vllm_release() == "0.20.1"  # the role default; the lab inventory does not override it
    home = tmp_path / "ddtree"
    for release in ("0.20.1", "0.26.0"):
        (home / f"vllm-{release}").mkdir(parents=True)
        data = json.loads((REPO / "ddtree/vllm-0.20.1/base.json").read_text())
        (home / f"vllm-{release}/base.json").write_text(json.dumps(dict(data, release=release)))

    def copied(release: str) -> list[str]:
        fakes = tmp_path / release / "opt" / "lab-fakes"
        fakes.mkdir(parents=True)
        labctl.copy_engine_rules(fakes, release, home)
        return sorted(p.parent.name for p in (fakes / "ddtree").glob("vllm-*/base.json"))

    assert copied("0.26.0") == ["vllm-0.26.0"]
    assert copied("0.20.1+cu130") == ["vllm-0.20.1"]
    assert copied("0.22.0") == ["vllm-0.20.1", "vllm-0.26.0"]


def test_on_a_node_the_stand_in_reserves_draft_slots_by_the_copied_descriptor(tmp_path, target, drafter):
    """Run as the unit runs it (through the `vllm` link): 32 sequences of DDTree 16 and 496 batched tokens."""
    import subprocess

    fakes = _node_fakes(tmp_path)
    knobs = tmp_path / "knobs.json"
    knobs.write_text(json.dumps({"vllm": {"die_at_start": True}}))  # past every refusal: exit 1 before serving
    tree = spec(method="ddtree", model=str(drafter), num_speculative_tokens=15, ddtree_budget=16)
    argv = [str(fakes / "vllm"), "serve", str(target), "--max-num-seqs", "32", "--max-num-batched-tokens", "496"]
    env = {"LAB_FAKES_KNOBS": str(knobs), "LAB_FAKES_HOLDERS": str(tmp_path / "holders"), "PATH": "/usr/bin:/bin"}

    def start() -> str:
        res = subprocess.run([*argv, "--speculative-config", tree], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 1
        return res.stderr

    # 0.20.1's rule: 15 slots a sequence, 480 in all, 16 tokens left to schedule.
    assert "engine died during start (knob die_at_start)" in start()
    # A base whose rule reserves the verified tokens themselves: 512 slots, 16 short.
    _set_draft_rule(fakes, 0)
    assert "error: max_num_scheduled_tokens is set to -16 based on the speculative decoding settings" in start()
    # Nothing to read the rule from: the stand-in says so instead of guessing one.
    (fakes / "ddtree_base.py").unlink()
    assert f"{fakes / 'ddtree_base.py'} is missing" in start()


def test_a_broken_or_ambiguous_descriptor_is_a_refusal_naming_it(tmp_path, target, drafter, monkeypatch):
    fakes = _node_fakes(tmp_path)
    monkeypatch.setattr(fake, "HERE", fakes)
    tree = spec(method="ddtree", model=str(drafter), num_speculative_tokens=15, ddtree_budget=16)
    _set_draft_rule(fakes, "-1")
    with pytest.raises(fake.Refusal, match=r"cannot read the DDTree base's rules: .*vllm-0\.20\.1/base\.json: "):
        engine(target, *SCHEDULER, "--speculative-config", tree)
    _set_draft_rule(fakes, -1)
    assert engine(target, *SCHEDULER, "--speculative-config", tree).speculative["ddtree_budget"] == 16
    (fakes / "ddtree/vllm-9.9.9").mkdir()
    (fakes / "ddtree/vllm-9.9.9/base.json").write_text("{}")
    with pytest.raises(fake.Refusal, match=r"has 2 bases \(0\.20\.1, 9\.9\.9\)"):
        engine(target, *SCHEDULER, "--speculative-config", tree)


def test_connections_beyond_the_accept_loop_wait_in_the_backlog_not_for_a_syn_retransmit():
    """32 clients connect while nothing accepts (a busy host): each is queued at once, as by vLLM's uvicorn."""
    import socket
    import threading

    e = fake.Engine(name="vllm", model_path="/nowhere", served_name="m", host="127.0.0.1", port=0, gpus=[0])
    server = fake.Server(("127.0.0.1", 0), fake.make_handler(e, threading.Event()))
    clients = []
    try:
        for _ in range(32):
            c = socket.create_connection(server.server_address, timeout=0.5)
            clients.append(c)
    finally:
        for c in clients:
            c.close()
        server.server_close()
    assert len(clients) == 32
