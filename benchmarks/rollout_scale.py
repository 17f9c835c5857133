#!/usr/bin/env python3
"""Benchmark how an idempotent site.yml run scales from one node to four, in one run.

    sudo .venv/bin/python benchmarks/rollout_scale.py [--nodes 4] [--repeats 3] [--keep-lab]

Brings up a lab of its own (tests/lab/labctl.py, lab ``bench-rollout``), fills the controller's
wheel cache (tests/lab/wheelhouse.yml), converges site.yml once on every node, then times
idempotent site.yml runs, interleaved and in a rotating order, ``--repeats`` times each:

- ``1 node``: ``-l <lab>-1``, the baseline;
- ``N nodes``: every node with the inventory's batching (default ``rollout_serial: [1, "25%"]``,
  so four nodes run as four batches one after the other);
- ``N nodes, one batch``: every node with ``-e '{"rollout_serial": ["100%"]}'``.

Each run must succeed and change nothing (otherwise the script stops and exits non-zero: an
idempotent run is what is measured). Prints the median wall time of each, its ratio to the one
node baseline (goal: N nodes <= 1.5x one node), the load average, and where the time of an N node
run goes: per play batch and the slowest tasks (benchmarks/callback/task_times.py). The lab is
removed at the end unless --keep-lab. Also prints the controller's own CPU-seconds per node (the
ansible-playbook process tree alone; goal: at most 5).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import cpu_busy

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONTROLLER_GOAL_S = 5.0  # issue 25: a 2-core controller should drive many nodes a minute
RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


class RunFailed(Exception):
    pass


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def ansible(args: list[str], env: dict[str, str], log: Path) -> tuple[cpu_busy.Interval, float, str]:
    """Run ansible-playbook: its wall time and busy cores (controller, SSH and lab nodes together),
    the CPU-seconds of the ansible-playbook process tree alone (the controller's cost), its output.

    The tree's CPU comes from getrusage(RUSAGE_CHILDREN): every process it started and reaped,
    workers and ssh clients; SSH ControlPersist masters detach and are not counted."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with cpu_busy.Interval() as span:
        res = subprocess.run([str(BIN / "ansible-playbook"), *args], cwd=REPO, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    controller = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    log.write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise RunFailed(
            f"ansible-playbook {' '.join(args)} failed (rc {res.returncode}); output in {log}:\n{res.stdout[-3000:]}"
        )
    return span, controller, res.stdout


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lab", default="bench-rollout")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fixtures", default="h200-x1,h200-x2")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and timings here (default: a temp dir)")
    p.add_argument("--keep-lab", action="store_true")
    a = p.parse_args(argv)
    if a.nodes < 2 or a.repeats < 1:
        p.error("--nodes must be at least 2 and --repeats at least 1")

    work = a.workdir or Path(tempfile.mkdtemp(prefix="rollout-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    inv = work / "inventory"
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_INJECT_FACT_VARS="False",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_CALLBACK_PLUGINS=f"{REPO / 'plugins/callback'}:{REPO / 'benchmarks/callback'}",
        ANSIBLE_CALLBACKS_ENABLED="rollout_report,task_times",
        DFLASH_REPORT_DIR=str(work / "reports"),
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
    )
    first = f"{a.lab}-1"
    modes = {
        "1 node": ["-l", first],
        f"{a.nodes} nodes": [],
        f"{a.nodes} nodes, one batch": ["-e", '{"rollout_serial": ["100%"]}'],
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    profiles: dict[str, list[dict]] = {m: [] for m in modes}
    cpu_seconds: dict[str, list[float]] = {m: [] for m in modes}
    controller_seconds: dict[str, list[float]] = {m: [] for m in modes}
    hosts = {m: 1 if "-l" in args else a.nodes for m, args in modes.items()}  # -l limits to one node
    print(f"work dir {work}; load average at start {load()}", flush=True)
    try:
        subprocess.run(
            [
                sys.executable,
                str(REPO / "tests/lab/labctl.py"),
                "up",
                f"--lab={a.lab}",
                f"--nodes={a.nodes}",
                f"--fixtures={a.fixtures}",
                f"--inventory-dir={inv}",
            ],
            check=True,
        )
        ansible(["-i", str(inv), "tests/lab/wheelhouse.yml"], env, work / "wheelhouse.log")
        span, _, _ = ansible(
            ["-i", str(inv), "site.yml"], dict(env, TASK_TIMES_FILE=str(work / "converge.json")), work / "converge.log"
        )
        print(f"converge on {a.nodes} nodes: {span.seconds:.1f} s", flush=True)
        names = list(modes)
        for r in range(a.repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for m in order:
                tag = f"{r + 1}-{m.replace(' ', '_').replace(',', '')}"
                prof = work / f"{tag}.json"
                span, controller, out = ansible(
                    ["-i", str(inv), "site.yml", *modes[m]], dict(env, TASK_TIMES_FILE=str(prof)), work / f"{tag}.log"
                )
                changed = {h: int(c) for h, _, c, _, _ in RECAP.findall(out) if int(c)}
                if changed:
                    raise RunFailed(f"{m}, repeat {r + 1}: not idempotent, changed: {changed} (log {work / tag}.log)")
                times[m].append(span.seconds)
                cpu_seconds[m].append(span.seconds * span.cores)
                controller_seconds[m].append(controller)
                profiles[m].append(json.loads(prof.read_text()))
                print(
                    f"repeat {r + 1}: {m:<22} {span.seconds:7.2f} s  (load {load()}; busy cores {span.cores:.2f}"
                    f" of {os.cpu_count()})",
                    flush=True,
                )
    except (RunFailed, subprocess.CalledProcessError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if not a.keep_lab:
            subprocess.run([sys.executable, str(REPO / "tests/lab/labctl.py"), "down", f"--lab={a.lab}"], check=False)

    base = statistics.median(times["1 node"])
    print(f"\nidempotent site.yml wall time, median of {a.repeats} (load average at end {load()}):")
    for m, ts in times.items():
        med = statistics.median(ts)
        runs = ", ".join(f"{t:.2f}" for t in ts)
        print(f"  {m:<22} {med:7.2f} s  ratio {med / base:5.2f}x  runs: {runs}")
    many = f"{a.nodes} nodes"
    verdict = "met" if statistics.median(times[many]) <= 1.5 * base else "NOT met"
    print(f"goal {many} <= 1.5x one node with default batching: {verdict}")
    # CPU time is the floor of wall time on this machine: whatever the batching, a run that needs
    # C CPU-seconds takes at least C / cores seconds.
    cores = os.cpu_count() or 1
    print(f"\nCPU-seconds used (controller, SSH and nodes together; {cores} cores):")
    for m, cs in cpu_seconds.items():
        floor = statistics.median(cs) / cores
        print(
            f"  {m:<22} {statistics.median(cs):7.1f} CPU-s  floor on {cores} cores {floor:6.2f} s = {floor / base:4.2f}x one node"
        )
    print(f"\ncontroller CPU-seconds per node (the ansible-playbook process tree alone; goal <= {CONTROLLER_GOAL_S}):")
    for m, cs in controller_seconds.items():
        per_node = statistics.median(cs) / hosts[m]
        verdict = "met" if per_node <= CONTROLLER_GOAL_S else "NOT met"
        print(f"  {m:<22} {statistics.median(cs):7.1f} CPU-s  {per_node:5.2f} per node  {verdict}")
    for m in (many, f"{a.nodes} nodes, one batch", "1 node"):
        prof = profiles[m][len(profiles[m]) // 2]
        print(f"\nwhere the time of one '{m}' run goes ({prof['total_seconds']:.1f} s inside ansible-playbook):")
        for b in prof["batches"]:
            print(f"  play batch {b['seconds']:6.2f} s  {b['play']}")
        top = sorted(prof["tasks"].items(), key=lambda kv: -kv[1]["seconds"])[:12]
        for name, t in top:
            print(f"  task {t['seconds']:6.2f} s  x{t['runs']}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
