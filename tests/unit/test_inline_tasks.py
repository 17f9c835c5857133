"""plugins/callback/inline_tasks.py: controller-only task runs and false whens are done without a
worker, with the same results, registered variables, facts and output as forked ones."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from inline_tasks import inlinable
from playbook_run import ansible_playbook

PLAYBOOK = """
- name: Every kind of task run the callback does here or leaves to a worker
  hosts: all
  gather_facts: false
  tasks:
    - name: Set a fact from a host variable
      ansible.builtin.set_fact:
        doubled: "{{ x * 2 }}"
    - name: Which process templates a set_fact, the controller or a worker
      ansible.builtin.set_fact:
        pid_a: "{{ lookup('ansible.builtin.pipe', 'echo $PPID') }}"
    - name: Which process templates the next one
      ansible.builtin.set_fact:
        pid_b: "{{ lookup('ansible.builtin.pipe', 'echo $PPID') }}"
    - name: A module run whose when is false on one host
      ansible.builtin.command: echo {{ inventory_hostname }}
      register: echoed
      changed_when: false
      when: x == 1
    - name: A module run whose when is false everywhere
      ansible.builtin.command: echo never
      register: never
      when: x == 99
    - name: A skipped include
      ansible.builtin.include_tasks: absent.yml
      when: x == 99
    - name: An assert that holds
      ansible.builtin.assert:
        that: doubled | int == x * 2
        quiet: true
    - name: A failure that is ignored
      ansible.builtin.fail:
        msg: failing {{ inventory_hostname }}
      when: x == 2
      ignore_errors: true
    - name: A block whose assert fails and is rescued
      block:
        - name: Fail on the second host
          ansible.builtin.assert:
            that: x == 1
            fail_msg: x is {{ x }}
      rescue:
        - name: Note the rescue
          ansible.builtin.set_fact:
            rescued: "{{ ansible_failed_result.msg }}"
    - name: A fact set once for every host
      ansible.builtin.set_fact:
        once: "{{ inventory_hostname }}"
      run_once: true
    - name: A message kept out of the output
      ansible.builtin.debug:
        msg: secret {{ x }}
      no_log: true
    - name: Say what was registered
      ansible.builtin.debug:
        msg: "{{ {'doubled': doubled, 'echoed': echoed.stdout | default(echoed.skipped), 'never': never,
                  'rescued': rescued | default(none), 'once': once} | to_json }}"
    - name: Write what each host has
      ansible.builtin.copy:
        content: "{{ {'pids': [pid_a, pid_b], 'echoed': echoed, 'never': never} | to_json }}"
        dest: "{{ out }}/{{ inventory_hostname }}.json"
        mode: "0644"
"""


def run(tmp_path: Path, inline: str) -> tuple[str, dict[str, dict]]:
    out = tmp_path / f"out{inline}"
    out.mkdir()
    hosts = "".join(
        f"    h{i}: {{x: {i}, ansible_connection: local, ansible_python_interpreter: {sys.executable}}}\n"
        for i in (1, 2)
    )
    (tmp_path / "hosts.yml").write_text(f"all:\n  vars: {{out: {out}}}\n  hosts:\n{hosts}")
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    res = ansible_playbook(
        "hosts.yml",
        "play.yml",
        cwd=tmp_path,
        ANSIBLE_NOCOLOR="1",
        DFLASH_INLINE_TASKS=inline,
        DFLASH_REPORT_DIR=str(tmp_path / "reports"),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    facts = {h: json.loads((out / f"h{h}.json").read_text()) for h in (1, 2)}
    # Where it ran and when: the same run in another directory at another time.
    output = re.sub(r"play-\d{8}T\d{6}Z", "play-TIME", res.stdout.replace(str(tmp_path), "TMP"))
    return output, facts


def comparable(output: str, facts: dict[str, dict]) -> tuple[list[list[str]], dict]:
    """The output per task, hosts in order (workers finish in any order), without timings."""
    blocks = [sorted(b.strip().splitlines()) for b in re.split(r"\n(?=TASK |PLAY RECAP)", output)]
    facts = copy.deepcopy(facts)
    for f in facts.values():
        for key in ("start", "end", "delta"):
            f["echoed"].pop(key, None)
        f.pop("pids")
    return blocks, facts


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[str, dict[str, dict]]]:
    return {inline: run(tmp_path_factory.mktemp(f"inline{inline}"), inline) for inline in ("0", "1")}


def test_the_output_results_and_registered_variables_are_the_same_as_with_workers(runs) -> None:
    forked, inlined = runs["0"], runs["1"]
    assert comparable(*inlined) == comparable(*forked)
    assert "PLAY RECAP" in inlined[0]
    assert re.search(
        r"h1\s+: ok=10\s+changed=1\s+unreachable=0\s+failed=0\s+skipped=3\s+rescued=0\s+ignored=0", inlined[0]
    )
    assert re.search(
        r"h2\s+: ok=9\s+changed=1\s+unreachable=0\s+failed=0\s+skipped=3\s+rescued=1\s+ignored=1", inlined[0]
    )
    assert '"rescued": "x is 2"' in inlined[0].replace('\\"', '"')
    assert "secret" not in inlined[0]


def test_set_facts_run_in_the_controller_and_are_forked_when_turned_off(runs) -> None:
    _, inlined = runs["1"]
    _, forked = runs["0"]
    for facts in inlined.values():
        a, b = facts["pids"]
        assert a == b  # one process, the controller's
    for facts in forked.values():
        a, b = facts["pids"]
        assert a != b  # a worker each


def task(**fields: object) -> SimpleNamespace:
    """The fields of a task the callback reads, as a task without them has them."""
    base = dict(loop=None, loop_with=None, delegate_to=None, async_val=0, until=[], timeout=0, debugger=None)
    return SimpleNamespace(**(base | fields))


def test_only_tasks_without_loops_delegation_async_retries_or_timeouts_are_done_here() -> None:
    assert inlinable(task())
    for extra in (
        {"loop": [1, 2]},
        {"loop_with": "items"},
        {"delegate_to": "localhost"},
        {"async_val": 10},
        {"until": ["true"]},
        {"timeout": 5},
        {"debugger": "on_failed"},
    ):
        assert not inlinable(task(**extra)), extra
