"""Inventory validation that runs before any host is contacted (site.yml's first play).

The roles' own argument specs are the source of truth for variable names and types, so a typo
(`service_swap_num_speculative_token`), a boolean written as a string ("yes") or a number in
quotes is reported by name before anything changes, in one sentence per problem. Settings of
different roles that describe the same thing must also agree (``combination_problems``).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
import yaml
from ansible.errors import AnsibleUndefinedVariable

# Variables that existed once and were removed or renamed: name -> what to do instead.
REMOVED: dict[str, str] = {
    "bench_report_dir": (
        "bench results go under the one report directory, in bench/: set report_dir in ansible.cfg's"
        " [rollout_report] section or the environment variable DFLASH_REPORT_DIR instead."
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


def load_specs(roles_dir: str) -> dict[str, dict[str, Any]]:
    """Every role's entry-point options, flattened to {variable name: option spec}."""
    specs: dict[str, dict[str, Any]] = {}
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
    for path, owner in files:
        data = yaml.safe_load(path.read_text()) or {}
        for entry in (data.get("argument_specs") or {}).values():
            for name, opt in (entry.get("options") or {}).items():
                specs[name] = dict(opt or {}, role=owner)
    return specs


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
    """``value`` as a message shows it: its repr, cut to MAX_SHOWN characters."""
    try:
        text = repr(value if type(value) in (str, int, float, bool) else _plain(value))
    except ValueError:  # an integer past Python's int-to-str limit
        return f"<{yaml_type(value)} too long to show>"
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


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


@functools.cache
def _role_defaults(path: Path) -> Mapping[str, Any]:
    """A role's defaults/main.yml, read once per run however many hosts and variables ask."""
    return (yaml.safe_load(path.read_text()) if path.is_file() else None) or {}


def _effective(name: str, hostvars: Mapping[str, Any], specs: Mapping[str, Any], roles_dir: str) -> tuple[Any, str]:
    """The host's value of a role variable, or its role's default; and which of the two it is."""
    value = hostvars.get(name)
    if name in hostvars and not isinstance(value, jinja2.Undefined):
        return value, "the inventory"
    defaults = _role_defaults(Path(roles_dir).resolve() / str(specs[name]["role"]) / "defaults" / "main.yml")
    return defaults.get(name), "the role default"


# Variables of different roles that name the same thing, and what it is.
SAME_VALUE: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("model_stage_dest", "drafter_config_drafter_dir", "service_swap_drafter_dir"),
        "the drafter's directory (model_stage puts the weights there, drafter_config writes config.json"
        " there, the vLLM unit loads the drafter from there)",
    ),
)


def combination_problems(hostvars: Mapping[str, Any], specs: Mapping[str, Any], roles_dir: str) -> list[str]:
    """Settings of different roles that must agree (each may come from the inventory or a default)."""
    problems = []
    for names, what in SAME_VALUE:
        if all(name in specs for name in names):
            values = [_effective(name, hostvars, specs, roles_dir) for name in names]
            if all(isinstance(v, str) for v, _ in values) and len({v for v, _ in values}) > 1:
                listed = ", ".join(f"{n} ({src}) is {v}" for n, (v, src) in zip(names, values, strict=True))
                problems.append(f"{listed}: they all name {what}; set them to the same path.")
    return problems + _sliding_problems(hostvars, specs, roles_dir)


def _sliding_problems(hostvars: Mapping[str, Any], specs: Mapping[str, Any], roles_dir: str) -> list[str]:
    names = ("drafter_config_layer_types", "vllm_install_sliding_drafter")
    if not all(name in specs for name in names):
        return []
    (layer_types, types_from), (sliding, sliding_from) = (_effective(n, hostvars, specs, roles_dir) for n in names)
    # [] lets the module decide: nothing to compare then.
    if not isinstance(layer_types, list) or not layer_types or not isinstance(sliding, bool):
        return []
    slides = sum(t == "sliding_attention" for t in layer_types)
    if bool(slides) == sliding:
        return []
    if slides:
        return [
            f"drafter_config_layer_types ({types_from}) marks {slides} of {len(layer_types)} draft layers"
            f" sliding_attention, but vllm_install_sliding_drafter ({sliding_from}) is false: both describe the"
            " same drafter. vLLM 0.20.1 with this project's change set refuses such a drafter when it starts,"
            " after SGLang is stopped; set vllm_install_sliding_drafter: true (its preflight then says which"
            " releases run it) or, for a drafter whose layers are all full attention, list them as full_attention."
        ]
    return [
        f"vllm_install_sliding_drafter ({sliding_from}) is true but drafter_config_layer_types ({types_from})"
        " has no sliding_attention layer: both describe the same drafter; set vllm_install_sliding_drafter:"
        " false, or list the drafter's sliding layers."
    ]


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
        problem = type_problem(name, value, specs[name])
        if problem:
            problems.append(problem)
    if not problems:  # comparing values of the wrong type would say less than the problems above
        problems.extend(combination_problems(hostvars, specs, roles_dir))
    return [f"{host}: {p}" for p in problems]


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"inventory_problems": inventory_problems}
