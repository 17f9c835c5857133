"""The lab tool's pure parts: each clone's lab name, and the measured figures it gives the lab."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import yaml

from ddtree.trained import decision

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("labctl", REPO / "tests" / "lab" / "labctl.py")
labctl = importlib.util.module_from_spec(_spec)
sys.modules["labctl"] = labctl
_spec.loader.exec_module(labctl)


def figures() -> dict:
    summary = json.loads(labctl.MEASURED_ACCEPTANCE.read_text())
    out = decision.replay(summary, decision.step_costs(decision.default_step_costs(), 512))
    out["source"] = {"acceptance": labctl.MEASURED_ACCEPTANCE.name, "step_costs": ["a.json"], "context": 512}
    return out


def test_each_clone_has_its_own_valid_lab_name(monkeypatch):
    name = labctl.default_lab_name()
    labctl.validate_name(name)
    monkeypatch.setattr(labctl, "REPO", Path("/elsewhere/dflash-deploy"))
    other = labctl.default_lab_name()
    labctl.validate_name(other)
    assert other != name
    assert labctl.bridge_name(other) != labctl.bridge_name(name)


def test_the_candidates_are_the_chain_and_every_measured_budget():
    figs = figures()
    candidates = labctl.replay_candidates(figs)
    assert candidates[0] == {"method": "dflash"}
    measured = {
        int(m[6:])
        for m, cells in figs["methods"].items()
        if m.startswith("ddtree") and any(c["mean_acceptance_length"] for k in cells.values() for c in k.values())
    }
    assert {c["budget"] for c in candidates[1:]} == measured
    assert measured  # the results of record measure at least one budget
    figs["methods"]["ddtree32"] = {"greedy": {"1": {"mean_acceptance_length": None, "ms_per_step": 1.0}}}
    assert {"method": "ddtree", "budget": 32} not in labctl.replay_candidates(figs)


def test_the_inventory_tunes_the_measured_candidates_and_retunes_changed_nodes(tmp_path, monkeypatch):
    monkeypatch.setattr(labctl, "STATE_ROOT", tmp_path / "state")
    lab = labctl.Lab(name="lab-abc123", subnet="10.213.7.0/24", bridge="dflbrx")
    lab.nodes = [
        labctl.Node(name="lab-abc123-1", address="10.213.7.11", fixture="h200-x1"),
        labctl.Node(name="lab-abc123-2", address="10.213.7.12", fixture="h200-x2"),
    ]
    figs = figures()
    labctl.write_inventory(lab, tmp_path / "inv", figs, ["lab-abc123-2"])
    inv = yaml.safe_load((tmp_path / "inv" / "hosts.yml").read_text())
    group = inv["all"]["children"]["gpu_nodes"]
    for host in group["hosts"].values():  # host variables: inventory/lab/group_vars/all would win over group ones
        assert host["tune_candidates"] == labctl.replay_candidates(figs)
        assert host["service_swap_min_acceptance_length"] == 1.2
        assert host["service_swap_max_num_seqs"] == 8
        assert host["tune_max_tokens"] == figs["max_tokens"]  # as long as the measured completions
    assert "tune_force" not in group["hosts"]["lab-abc123-1"]
    assert group["hosts"]["lab-abc123-2"]["tune_force"] is True
    labctl.write_inventory(lab, tmp_path / "plain")  # without --replay-measured: the group_vars' settings
    plain = yaml.safe_load((tmp_path / "plain" / "hosts.yml").read_text())["all"]["children"]["gpu_nodes"]
    assert "tune_candidates" not in plain["hosts"]["lab-abc123-1"]
