"""Inventory validation that runs before any host is contacted (site.yml's first play).

The roles' own argument specs are the source of truth for variable names and types, so a typo
(`service_swap_num_speculative_token`), a boolean written as a string ("yes") or a number in
quotes is reported by name before anything changes, in one sentence per problem. A setting several
roles read is defined once, in roles/shared_settings, so there is nothing for two roles to disagree on.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ansible.module_utils
import jinja2
import yaml
from ansible import constants as C
from ansible.errors import AnsibleUndefinedVariable

for _p in [*(C.DEFAULT_MODULE_UTILS_PATH or []), str(Path(__file__).resolve().parents[2] / "module_utils")]:
    if os.path.isdir(_p) and _p not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(_p)

from ansible.module_utils.bounded_value import MAX_DEPTH, MAX_ELEMENTS, bounded_repr, measure

# Variables that existed once and were removed or renamed: name -> what to do instead. The
# settings several roles shared moved to roles/shared_settings, one name each (issue 25).
REMOVED: dict[str, str] = {
    "bench_report_dir": (
        "bench results go under the one report directory, in bench/: set report_dir in ansible.cfg's"
        " [rollout_report] section or the environment variable DFLASH_REPORT_DIR instead."
    ),
    **{
        old: f"it is now {new}, one setting that every role reading it shares (roles/shared_settings)."
        for old, new in (
            ("model_stage_dest", "shared_settings_drafter_dir"),
            ("drafter_config_drafter_dir", "shared_settings_drafter_dir"),
            ("service_swap_drafter_dir", "shared_settings_drafter_dir"),
            ("model_stage_target_dir", "shared_settings_target_dir"),
            ("drafter_config_target_dir", "shared_settings_target_dir"),
            ("ddtree_patch_target_dir", "shared_settings_target_dir"),
            ("service_swap_target_dir", "shared_settings_target_dir"),
            ("model_stage_owner", "shared_settings_service_user"),
            ("vllm_install_user", "shared_settings_service_user"),
            ("service_swap_user", "shared_settings_service_user"),
            ("vllm_account_user", "shared_settings_service_user"),
            ("model_stage_group", "shared_settings_service_group"),
            ("vllm_install_group", "shared_settings_service_group"),
            ("vllm_account_group", "shared_settings_service_group"),
            ("model_stage_owner_home", "shared_settings_service_home"),
            ("service_swap_home", "shared_settings_service_home"),
            ("vllm_account_home", "shared_settings_service_home"),
            ("model_stage_owner_create", "shared_settings_service_user_create"),
            ("vllm_install_create_user", "shared_settings_service_user_create"),
            ("drafter_config_layer_types", "shared_settings_drafter_layer_types"),
            ("drafter_config_block_size", "shared_settings_drafter_block_size"),
            ("service_swap_drafter_block_size", "shared_settings_drafter_block_size"),
            ("ddtree_patch_depth", "shared_settings_num_speculative_tokens"),
            ("service_swap_num_speculative_tokens", "shared_settings_num_speculative_tokens"),
            ("vllm_install_num_speculative_tokens", "shared_settings_num_speculative_tokens"),
            ("ddtree_patch_budget", "shared_settings_ddtree_budget"),
            ("service_swap_ddtree_budget", "shared_settings_ddtree_budget"),
            ("ddtree_patch_vllm_version", "shared_settings_vllm_version"),
            ("service_swap_vllm_version", "shared_settings_vllm_version"),
            ("vllm_install_version", "shared_settings_vllm_version"),
            ("vllm_install_root", "shared_settings_vllm_root"),
            ("gpu_check_nvidia_smi_path", "shared_settings_nvidia_smi_path"),
            ("service_swap_nvidia_smi_path", "shared_settings_nvidia_smi_path"),
            ("gpu_check_driver_version_path", "shared_settings_driver_version_path"),
            ("service_swap_driver_version_path", "shared_settings_driver_version_path"),
            ("service_swap_sglang_unit", "shared_settings_sglang_unit"),
            ("service_swap_vllm_unit", "shared_settings_vllm_unit"),
            ("gpu_check_memory_utilization", "shared_settings_gpu_memory_utilization"),
            ("service_swap_gpu_memory_utilization", "shared_settings_gpu_memory_utilization"),
        )
    },
    "vllm_install_sliding_drafter": (
        "vllm_install reads whether the drafter's layers slide from shared_settings_drafter_layer_types"
        " (any sliding_attention entry); set that list instead."
    ),
    "ddtree_patch_venv": "the venv is <shared_settings_vllm_root>/<shared_settings_vllm_version>: set those.",
    **{
        old: (
            "tune measures and weighs the concurrencies of tune_traffic, such as [{concurrency: 1, weight: 1},"
            " {concurrency: 8, weight: 2}] (docs/tune.md); set that instead."
        )
        for old in ("tune_concurrency", "tune_pick_concurrency")
    },
    "service_swap_venv": (
        "the venv is <shared_settings_vllm_root>/<shared_settings_vllm_version>: set those, or"
        " service_swap_vllm_executable for another vllm executable."
    ),
}

_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "path": (str,),
    "raw": (object,),
    "list": (list, tuple),
    "dict": (dict, Mapping),
}


# The parsed specs of the last set of files read, keyed by each file's path, mtime and size: one run
# checks the inventory several times (every node, every check), and parsing the eleven spec files
# each time cost about a quarter of a CPU-second of the controller per run (issue 25).
_SPECS_CACHE: dict[tuple[tuple[str, int, int], ...], dict[str, dict[str, Any]]] = {}
# libyaml's parser and constructor where PyYAML has them (its wheels do), else the pure-Python ones.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_specs(roles_dir: str) -> dict[str, dict[str, Any]]:
    """Every role's entry-point options, flattened to {variable name: option spec} (the caller's own copy)."""
    files = [(p, p.parts[-3]) for p in sorted(Path(roles_dir).glob("*/meta/argument_specs.yml"))]
    # The playbooks' own variables sit beside them: playbooks/vars/<prefix>_argument_specs.yml
    # (rollout_* for site.yml's batches, rollback_* for playbooks/rollback.yml).
    playbook_specs = sorted((Path(roles_dir).parent / "playbooks" / "vars").glob("*_argument_specs.yml"))
    files.extend((p, p.name.removesuffix("_argument_specs.yml")) for p in playbook_specs)
    if not Path(roles_dir).is_dir() or not files:
        # No specs means no checks at all: fail closed, not open.
        raise ValueError(
            f"no roles/*/meta/argument_specs.yml under {roles_dir}: the inventory cannot be checked; run from the"
            " repository (its roles directory) or fix the path given to inventory_problems"
        )
    key = tuple((str(p), st.st_mtime_ns, st.st_size) for p, st in ((p, p.stat()) for p, _owner in files))
    specs = _SPECS_CACHE.get(key)
    if specs is None:
        specs = {}
        for path, owner in files:
            data = yaml.load(path.read_text(), Loader=_SAFE_LOADER) or {}
            for entry in (data.get("argument_specs") or {}).values():
                for name, opt in (entry.get("options") or {}).items():
                    specs[name] = dict(opt or {}, role=owner)
        _SPECS_CACHE.clear()
        _SPECS_CACHE[key] = specs
    return copy.deepcopy(specs)


# Names whose values are never echoed, whatever their spec says (no_log in the spec also hides one).
_SECRET_NAME = re.compile(r"key|password|passwd|token|secret|credential", re.IGNORECASE)
# Unknown variables that get a "did you mean" (each suggestion compares with every known name).
MAX_SUGGESTIONS = 50
# Echoed values are cut to this many characters: a message names the problem, not the whole value.
MAX_SHOWN = 60


def is_secret(name: str, spec: Mapping[str, Any]) -> bool:
    return bool(spec.get("no_log")) or bool(_SECRET_NAME.search(name))


def yaml_type(value: Any) -> str:
    """The YAML type an operator wrote (str, int, bool, ...), not ansible-core's internal class name."""
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (Mapping, "dict")):
        if isinstance(value, kind):
            return name
    if isinstance(value, list | tuple):
        return "list"
    if value is None:
        return "null"
    return type(value).__name__.removeprefix("_AnsibleTagged").lower() or "value"


def shown(value: Any) -> str:
    """``value`` as a message shows it: a repr of at most MAX_SHOWN characters, built without visiting
    more of the value than that (an alias bomb's repr never finished, issue 43)."""
    return bounded_repr(_plain(value), MAX_SHOWN)


def size_problem(name: str, value: Any) -> str | None:
    """One sentence when ``value`` is larger or deeper than any setting, found with bounded work."""
    size = measure(value)
    if size.too_large:
        return (
            f"{name} holds more than {MAX_ELEMENTS} elements ({yaml_type(value)}), far more than any setting: a YAML"
            " alias that expands into itself many times over? Write the value out."
        )
    if size.too_deep:
        return f"{name} is nested more than {MAX_DEPTH} levels deep ({yaml_type(value)}); no setting is: write it out."
    return None


def _plain(value: Any) -> Any:
    """Scalars as their plain Python type, so a repr never shows an ansible-core class name."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


def template_failure(value: Any) -> str | None:
    """Why a templated value failed to render (a syntax or runtime error), None for a plain undefined.

    ansible-core 2.19+ hands a failed template over as an exception marker (an Undefined that
    carries the error); an undefined name (a role default not loaded yet) is not a failure.
    """
    as_exception = getattr(value, "_as_exception", None)
    if as_exception is None:
        return None
    try:
        exc = as_exception()
        if isinstance(exc, AnsibleUndefinedVariable):
            return None  # a name not defined yet (a role default): the role checks it on entry
        text = str(exc)
    except Exception:  # whatever the marker holds, the variable is reported
        return type(value).__name__
    return text.splitlines()[0] if text else type(exc).__name__


def _is_string_bool(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("yes", "no", "true", "false", "on", "off")


def type_problem(name: str, value: Any, spec: Mapping[str, Any]) -> str | None:
    """One sentence if `value` cannot be what the role's argument spec says `name` is."""
    want = spec.get("type", "str")
    if value is None:
        return None
    secret = is_secret(name, spec)

    def show(v: Any) -> str:
        return "(a secret, not shown)" if secret else shown(v)

    if want == "bool" and _is_string_bool(value):
        # true/false only: yes/no/on/off are booleans to YAML 1.1 but .yamllint allows only true/false.
        word = "true" if value.strip().lower() in ("yes", "true", "on") else "false"
        return f"{name} is the string {show(value)}; write {word} without quotes so it is a boolean."
    if want in ("int", "float") and isinstance(value, bool):
        return f"{name} must be a number, not the boolean {show(value)}."
    if want in ("int", "float") and isinstance(value, str):
        return f"{name} is the string {show(value)}; it must be a number: write it without quotes."
    if want in ("int", "float") and isinstance(value, float) and not math.isfinite(value):
        # YAML's .inf and .nan are floats, but no setting means them: .inf passes "above 1.0" (issue 43).
        return f"{name} is {show(value)}; it must be a finite number."
    if not isinstance(value, _TYPES.get(want, (object,))):
        scalar = yaml_type(value) in ("int", "float", "bool")
        quote = " (quote it so YAML reads a string)" if want in ("str", "path") and scalar else ""
        return f"{name} must be a {want}, but the inventory gives {yaml_type(value)} {show(value)}{quote}."
    choices = spec.get("choices")
    if choices:
        # A list option's choices apply to each element.
        values = value if want == "list" else [value]
        bad = [v for v in values if v not in choices]
        if bad:
            what = f"has {show(bad[0])}" if want == "list" else f"is {show(value)}"
            return f"{name} {what}; it must be one of: {', '.join(map(str, choices))}."
    return None


def inventory_problems(
    hostvars: Mapping[str, Any],
    host: str,
    roles_dir: str,
    removed: Mapping[str, str] | None = None,
) -> list[str]:
    """Every problem with one host's variables, each as a sentence an operator can act on."""
    specs = load_specs(roles_dir)
    prefixes = tuple(sorted({f"{spec['role']}_" for spec in specs.values()}))
    removed = REMOVED if removed is None else removed
    problems: list[str] = []
    unknown = 0
    # No ansible_host is fine: Ansible then connects to the inventory name, which may be a DNS name.
    for name in sorted(hostvars):
        if name in removed:
            problems.append(f"{name} is no longer used: {removed[name]}")
            continue
        if not name.startswith(prefixes) or name.startswith("_"):
            continue
        if name not in specs:
            unknown += 1
            # Suggestions cost a comparison with every known name: only for the first few.
            close = difflib.get_close_matches(name, list(specs), n=1) if unknown <= MAX_SUGGESTIONS else []
            hint = f" Did you mean {close[0]}?" if close else ""
            problems.append(f"{name} is not a variable of any role.{hint}")
            continue
        value = hostvars[name]
        if isinstance(value, jinja2.Undefined):
            failure = template_failure(value)
            if failure is not None:
                shown = "" if is_secret(name, specs[name]) else f" ({failure[:200]})"
                problems.append(
                    f"{name} is a template that cannot be rendered{shown}; fix it (its Jinja, or the vault password)."
                )
            # Otherwise it refers to a role default: the role's own argument spec checks it on entry.
            continue
        # Measured first, with bounded work: no text is built from a value too large to be a setting.
        problem = size_problem(name, value) or type_problem(name, value, specs[name])
        if problem:
            problems.append(problem)
    return [f"{host}: {p}" for p in problems]


# Play keywords that site.yml takes from the play's first node (serial and max_fail_percentage are
# templated before any host is chosen); their defaults are in playbooks/vars/rollout_argument_specs.yml.
ROLLOUT_SETTINGS = ("rollout_serial", "rollout_max_fail_percentage")
_PERCENT = re.compile(r"^\s*(\d{1,9})\s*%$")
_COUNT = re.compile(r"^\s*(\d{1,9})\s*$")


def _batch_ok(item: Any) -> bool:
    if isinstance(item, bool) or not isinstance(item, int | str):
        return False
    if isinstance(item, int):
        return item >= 1
    percent, count = _PERCENT.match(item), _COUNT.match(item)
    if percent:
        return 0 < int(percent.group(1)) <= 100
    return bool(count) and int(count.group(1)) >= 1


def _serial_problem(value: Any) -> str | None:
    if not isinstance(value, list | tuple):
        return None  # inventory_problems reports a value that is not a list
    if not value:
        return "rollout_serial is an empty list; give at least one batch size."
    for item in value:
        if not _batch_ok(item):
            return (
                f"rollout_serial has {shown(item)}; each batch is a number of nodes (at least 1) or a"
                ' percentage of them above 0 and at most 100 ("25%").'
            )
    return None


def rollout_setting(hostvars: Mapping[str, Mapping[str, Any]], hosts: list[str], name: str, roles_dir: str) -> Any:
    """The value a play takes for a rollout setting: its first node's, else the default of
    playbooks/vars/rollout_argument_specs.yml (the one place it is written)."""
    if name not in ROLLOUT_SETTINGS:
        raise ValueError(f"{name} is not a rollout setting ({', '.join(ROLLOUT_SETTINGS)})")
    default = load_specs(roles_dir)[name].get("default")
    return hostvars[hosts[0]].get(name, default) if hosts else default


def rollout_problems(hostvars: Mapping[str, Mapping[str, Any]], hosts: list[str], roles_dir: str) -> list[str]:
    """The rollout settings an operator can set wrongly for a whole play, one sentence each.

    Ansible takes serial and max_fail_percentage once per play, from the play's first node, so a
    value that differs between nodes (set in one class's group_vars) would silently be the first
    node's for all of them: that is refused, naming where each value comes from.
    """
    specs = load_specs(roles_dir)
    problems: list[str] = []
    for name in ROLLOUT_SETTINGS:
        default = specs[name].get("default")
        shown_as: dict[str, str] = {}
        values: dict[str, list[str]] = {}
        for host in hosts:
            value = hostvars[host].get(name, default)
            too_large = size_problem(name, value)
            if too_large:  # json.dumps below would walk all of it
                problems.append(f"{too_large} (on {host})")
                break
            key = json.dumps(value, default=str, sort_keys=True)
            shown_as.setdefault(key, shown(value))
            values.setdefault(key, []).append(host)
        if problems and problems[-1].startswith(name):
            continue
        if len(values) > 1:
            where = "; ".join(
                f"{shown_as[k]} on {', '.join(h[:3])}{' and others' if len(h) > 3 else ''}" for k, h in values.items()
            )
            problems.append(
                f"{name} differs between the nodes ({where}); a play takes one value for all of them: set it"
                " once, in group_vars/all or with -e."
            )
            continue
        value = rollout_setting(hostvars, hosts, name, roles_dir)
        if name == "rollout_serial":
            problem = _serial_problem(value)
        elif isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= 100:
            problem = f"{name} is {shown(value)}; it is a percentage of a batch, 0 to 100."
        else:
            problem = None
        if problem:
            problems.append(problem)
    return problems


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "inventory_problems": inventory_problems,
            "rollout_problems": rollout_problems,
            "rollout_setting": rollout_setting,
        }
