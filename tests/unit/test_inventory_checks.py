"""site.yml's first play: inventory problems found from the roles' argument specs."""

from pathlib import Path

import inventory_checks
import pytest
from inventory_checks import inventory_problems, load_specs, rollout_problems, rollout_setting, type_problem

SPEC = """\
argument_specs:
  main:
    options:
      demo_role_enabled: {type: bool}
      demo_role_port: {type: int}
      demo_role_method: {type: str, choices: [dflash, ddtree]}
      demo_role_paths: {type: list, elements: str}
"""


@pytest.fixture
def roles(tmp_path: Path) -> str:
    meta = tmp_path / "demo_role" / "meta"
    meta.mkdir(parents=True)
    (meta / "argument_specs.yml").write_text(SPEC)
    return str(tmp_path)


def test_specs_are_read_per_role(roles: str) -> None:
    specs = load_specs(roles)
    assert sorted(specs) == ["demo_role_enabled", "demo_role_method", "demo_role_paths", "demo_role_port"]
    assert specs["demo_role_port"] == {"type": "int", "role": "demo_role"}


def test_specs_are_parsed_once_but_read_again_when_a_file_changes(roles: str, monkeypatch) -> None:
    parses = []
    real_load = inventory_checks.yaml.load
    monkeypatch.setattr(inventory_checks.yaml, "load", lambda *a, **k: parses.append(1) or real_load(*a, **k))
    first = load_specs(roles)
    load_specs(roles)
    assert len(parses) == 1
    first["demo_role_port"]["type"] = "changed by a caller"  # each caller gets its own copy
    assert load_specs(roles)["demo_role_port"]["type"] == "int"
    spec = Path(roles) / "demo_role" / "meta" / "argument_specs.yml"
    spec.write_text(SPEC + "      demo_role_added: {type: str}\n")
    assert load_specs(roles)["demo_role_added"] == {"type": "str", "role": "demo_role"}
    assert len(parses) == 2


def test_a_good_host_has_no_problems(roles: str) -> None:
    hv = {
        "ansible_host": "10.0.0.5",
        "demo_role_enabled": True,
        "demo_role_port": 8000,
        "demo_role_method": "ddtree",
        "demo_role_paths": ["/a"],
        "other_var": "x",
    }
    assert inventory_problems(hv, "gpu1", roles) == []


def test_every_problem_is_one_sentence_naming_the_host(roles: str) -> None:
    hv = {
        "demo_role_enabled": "yes",
        "demo_role_port": "8000",
        "demo_role_method": "eagle",
        "demo_role_paths": "/a",
        "demo_role_portt": 1,
    }
    assert inventory_problems(hv, "gpu1", roles) == [
        "gpu1: demo_role_enabled is the string 'yes'; write true without quotes so it is a boolean.",
        "gpu1: demo_role_method is 'eagle'; it must be one of: dflash, ddtree.",
        "gpu1: demo_role_paths must be a list, but the inventory gives str '/a'.",
        "gpu1: demo_role_port is the string '8000'; it must be a number: write it without quotes.",
        "gpu1: demo_role_portt is not a variable of any role. Did you mean demo_role_port?",
    ]


@pytest.mark.parametrize(
    ("value", "word"), [("yes", "true"), ("True", "true"), ("on", "true"), ("no", "false"), ("OFF", "false")]
)
def test_a_boolean_in_quotes_is_told_to_be_true_or_false_which_yamllint_allows(roles: str, value, word) -> None:
    assert inventory_problems({"demo_role_enabled": value}, "gpu1", roles) == [
        f"gpu1: demo_role_enabled is the string {value!r}; write {word} without quotes so it is a boolean."
    ]


def test_a_node_named_by_dns_needs_no_ansible_host(roles: str) -> None:
    assert inventory_problems({"demo_role_port": 8000}, "gpu1.example.net", roles) == []


def test_removed_variables_say_what_to_do(roles: str) -> None:
    hv = {"ansible_host": "h", "old_flag": True}
    problems = inventory_problems(hv, "gpu1", roles, removed={"old_flag": "use demo_role_enabled instead."})
    assert problems == ["gpu1: old_flag is no longer used: use demo_role_enabled instead."]


@pytest.mark.parametrize(
    ("value", "spec", "expected"),
    [
        (True, {"type": "int"}, "x must be a number, not the boolean True."),
        (3, {"type": "float"}, None),
        (None, {"type": "int"}, None),
        ({"a": 1}, {"type": "dict"}, None),
        ("no", {"type": "str"}, None),
        (["a", "b"], {"type": "list", "choices": ["a", "b"]}, None),
        (["a", "c"], {"type": "list", "choices": ["a", "b"]}, "x has 'c'; it must be one of: a, b."),
    ],
)
def test_type_rules(value, spec, expected) -> None:
    assert type_problem("x", value, spec) == expected


def test_the_rollout_variables_are_checked_from_their_spec_beside_the_playbooks(tmp_path: Path) -> None:
    (tmp_path / "roles").mkdir()
    (tmp_path / "playbooks" / "vars").mkdir(parents=True)
    (tmp_path / "playbooks" / "vars" / "rollout_argument_specs.yml").write_text(
        "argument_specs:\n  main:\n    options:\n      rollout_serial: {type: list}\n"
    )
    hv = {"ansible_host": "h", "rollout_serial": "1", "rollout_serail": [1]}
    assert inventory_problems(hv, "n", str(tmp_path / "roles")) == [
        "n: rollout_serail is not a variable of any role. Did you mean rollout_serial?",
        "n: rollout_serial must be a list, but the inventory gives str '1'.",
    ]


def test_the_rollback_variables_are_checked_from_their_own_spec_file(tmp_path: Path) -> None:
    (tmp_path / "roles").mkdir()
    (tmp_path / "playbooks" / "vars").mkdir(parents=True)
    (tmp_path / "playbooks" / "vars" / "rollback_argument_specs.yml").write_text(
        "argument_specs:\n  main:\n    options:\n"
        "      rollback_to: {type: str, choices: [sglang, previous_vllm]}\n"
        "      rollback_ddtree_patch: {type: raw}\n"
    )
    hv = {"ansible_host": "h", "rollback_to": "previous", "rollback_too": "sglang", "rollback_ddtree_patch": "true"}
    assert inventory_problems(hv, "n", str(tmp_path / "roles")) == [
        "n: rollback_to is 'previous'; it must be one of: sglang, previous_vllm.",
        "n: rollback_too is not a variable of any role. Did you mean rollback_to?",
    ]
    assert inventory_problems({"ansible_host": "h", "rollback_to": "previous_vllm"}, "n", str(tmp_path / "roles")) == []


def test_the_repository_s_rollback_spec_accepts_both_targets_and_nothing_else() -> None:
    roles = str(Path(__file__).resolve().parents[2] / "roles")
    for good in ("sglang", "previous_vllm"):
        assert inventory_problems({"ansible_host": "h", "rollback_to": good}, "n", roles) == []
    assert inventory_problems({"ansible_host": "h", "rollback_to": "vllm"}, "n", roles) == [
        "n: rollback_to is 'vllm'; it must be one of: sglang, previous_vllm."
    ]


# --- the settings several roles share: one name each, the old names told where they went ----------

REPO_ROLES = str(Path(__file__).resolve().parents[2] / "roles")


def _problems(**hostvars: object) -> list[str]:
    return inventory_problems({"ansible_host": "10.0.0.5", **hostvars}, "gpu-a", REPO_ROLES)


def test_a_shared_setting_is_a_known_variable_with_its_type_checked() -> None:
    assert _problems(shared_settings_drafter_dir="/opt/models/Qwen3.5-27B-DFlash") == []
    assert _problems(shared_settings_drafter_layer_types=["full_attention"] * 5) == []
    assert _problems(shared_settings_service_user_create="no") == [
        "gpu-a: shared_settings_service_user_create is the string 'no'; write false without quotes so it is a boolean."
    ]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("model_stage_dest", "shared_settings_drafter_dir"),
        ("drafter_config_drafter_dir", "shared_settings_drafter_dir"),
        ("service_swap_drafter_dir", "shared_settings_drafter_dir"),
        ("service_swap_user", "shared_settings_service_user"),
        ("vllm_install_version", "shared_settings_vllm_version"),
    ],
)
def test_a_role_s_old_name_for_a_shared_setting_names_the_new_one(old: str, new: str) -> None:
    assert _problems(**{old: "x"}) == [
        f"gpu-a: {old} is no longer used: it is now {new}, one setting that every role reading it shares"
        " (roles/shared_settings)."
    ]


def test_the_old_sliding_flag_points_at_the_layer_types() -> None:
    assert _problems(vllm_install_sliding_drafter=False) == [
        "gpu-a: vllm_install_sliding_drafter is no longer used: vllm_install reads whether the drafter's layers"
        " slide from shared_settings_drafter_layer_types (any sliding_attention entry); set that list instead."
    ]


@pytest.mark.parametrize("old", ["tune_pick_concurrency", "tune_concurrency"])
def test_the_old_tuning_concurrency_points_at_the_traffic(old: str) -> None:
    assert _problems(**{old: 8}) == [
        f"gpu-a: {old} is no longer used: tune measures and weighs the concurrencies of tune_traffic, such as"
        " [{concurrency: 1, weight: 1}, {concurrency: 8, weight: 2}] (docs/tune.md); set that instead."
    ]


# --- never echo a secret; bounded, YAML-named values (issue 23, item 2) -----------------------


def _tagged(value):
    """A value as ansible-core 2.19+ hands it to the filter: tagged with its origin."""
    from ansible._internal._datatag._tags import Origin

    return Origin(path="/inventory/hosts.yml", line_num=3).tag(value)


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("service_swap_api_key", {"type": "str", "no_log": True}),
        ("demo_role_api_key", {"type": "str"}),
        ("demo_role_password", {"type": "str"}),
        ("demo_role_hf_token", {"type": "str"}),
        ("demo_role_client_secret", {"type": "str"}),
        ("demo_role_plain", {"type": "str", "no_log": True}),
    ],
)
def test_a_secret_value_is_never_echoed(name, spec) -> None:
    problem = type_problem(name, _tagged(918273645501), spec)
    assert problem == (
        f"{name} must be a str, but the inventory gives int (a secret, not shown) (quote it so YAML reads a string)."
    )
    assert "918273645501" not in problem
    assert "918273" not in str(type_problem(name, _tagged("yes"), {**spec, "type": "bool"}))


def test_type_names_are_yaml_names_not_ansible_core_classes() -> None:
    assert type_problem("x", _tagged(5), {"type": "list"}) == "x must be a list, but the inventory gives int 5."
    assert type_problem("x", _tagged([1]), {"type": "str"}) == "x must be a str, but the inventory gives list [1]."
    assert type_problem("x", _tagged({"a": 1}), {"type": "list"}) == (
        "x must be a list, but the inventory gives dict {'a': 1}."
    )
    assert type_problem("x", _tagged(True), {"type": "dict"}) == "x must be a dict, but the inventory gives bool True."


def test_echoed_values_are_capped() -> None:
    long = type_problem("x", _tagged("a" * 5000), {"type": "str", "choices": ["a"]})
    assert long == "x is '" + "a" * 56 + "...; it must be one of: a."
    huge = type_problem("x", 10**5000, {"type": "str"})
    assert (
        huge == "x must be a str, but the inventory gives int <int too long to show> (quote it so YAML reads a string)."
    )
    assert len(type_problem("x", list(range(10000)), {"type": "str"})) < 120


def test_the_repository_spec_marks_the_api_key_no_log() -> None:
    specs = load_specs(str(Path(__file__).resolve().parents[2] / "roles"))
    hv = {"ansible_host": "10.0.0.5", "service_swap_api_key": _tagged(123456789)}
    problems = inventory_problems(hv, "gpu1", str(Path(__file__).resolve().parents[2] / "roles"))
    assert specs["service_swap_api_key"]["no_log"] is True
    assert problems == [
        "gpu1: service_swap_api_key must be a str, but the inventory gives int (a secret, not shown)"
        " (quote it so YAML reads a string)."
    ]


def test_extra_environment_is_never_echoed_it_often_carries_a_token() -> None:
    roles = str(Path(__file__).resolve().parents[2] / "roles")
    hv = {"ansible_host": "10.0.0.5", "service_swap_extra_env": _tagged("HF_TOKEN=hf_SECRETSECRET")}
    assert inventory_problems(hv, "gpu1", roles) == [
        "gpu1: service_swap_extra_env must be a dict, but the inventory gives str (a secret, not shown)."
    ]


def test_a_missing_roles_directory_fails_closed(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"no roles/\*/meta/argument_specs.yml under .*: the inventory cannot be checked"
    ):
        inventory_problems({"ansible_host": "h"}, "gpu1", str(tmp_path / "nope"))


def test_many_unknown_variables_stay_fast(roles: str) -> None:
    import time

    hv = {"ansible_host": "h", **{f"demo_role_typo{i}": 1 for i in range(20000)}}
    started = time.monotonic()
    problems = inventory_problems(hv, "gpu1", roles)
    assert time.monotonic() - started < 5
    assert len(problems) == 20000


def test_a_rollout_setting_left_to_its_default_on_some_nodes_agrees_with_the_same_value_written_out() -> None:
    hostvars = {"a": {"rollout_serial": [1, "25%"], "rollout_max_fail_percentage": 0}, "b": {}}
    assert rollout_problems(hostvars, ["a", "b"], REPO_ROLES) == []


def test_rollout_settings_that_differ_name_the_nodes_of_each_value() -> None:
    hostvars = {f"ct{i}": {"rollout_max_fail_percentage": 10} for i in range(5)} | {"ct9": {}}
    assert rollout_problems(hostvars, sorted(hostvars), REPO_ROLES) == [
        "rollout_max_fail_percentage differs between the nodes (10 on ct0, ct1, ct2 and others; 0 on ct9); a play"
        " takes one value for all of them: set it once, in group_vars/all or with -e."
    ]


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("rollout_serial", [], "rollout_serial is an empty list; give at least one batch size."),
        (
            "rollout_serial",
            [1, 0],
            "rollout_serial has 0; each batch is a number of nodes (at least 1) or a percentage",
        ),
        ("rollout_serial", ["0%"], "rollout_serial has '0%'; each batch is a number of nodes"),
        ("rollout_serial", ["150%"], "rollout_serial has '150%'; each batch"),
        ("rollout_serial", ["half"], "rollout_serial has 'half'; each batch"),
        ("rollout_serial", ["12.5%"], "rollout_serial has '12.5%'; each batch"),
        ("rollout_serial", ["0"], "rollout_serial has '0'; each batch"),
        ("rollout_serial", ["9" * 5000 + "%"], "rollout_serial has '99999"),
        ("rollout_serial", [True], "rollout_serial has True; each batch"),
        ("rollout_max_fail_percentage", 101, "rollout_max_fail_percentage is 101; it is a percentage of a batch"),
        ("rollout_max_fail_percentage", -1, "rollout_max_fail_percentage is -1; it is a percentage of a batch"),
    ],
)
def test_rollout_values_ansible_cannot_batch_by_are_refused(name: str, value, expected: str) -> None:
    [problem] = rollout_problems({"ct1": {name: value}}, ["ct1"], REPO_ROLES)
    assert problem.startswith(expected)


@pytest.mark.parametrize("serial", [[1], [1, "25%"], ["100%"], ["12 %", 3], ["2"], [2, 5, "50%"]])
def test_batch_sizes_ansible_takes_pass(serial) -> None:
    assert rollout_problems({"ct1": {"rollout_serial": serial}}, ["ct1"], REPO_ROLES) == []


def test_a_play_takes_its_first_nodes_rollout_setting_else_the_specs_default() -> None:
    hostvars = {"a": {"rollout_serial": [2]}, "b": {}}
    assert rollout_setting(hostvars, ["a", "b"], "rollout_serial", REPO_ROLES) == [2]
    assert rollout_setting(hostvars, ["b", "a"], "rollout_serial", REPO_ROLES) == [1, "25%"]
    assert rollout_setting(hostvars, [], "rollout_max_fail_percentage", REPO_ROLES) == 0
    with pytest.raises(ValueError, match="not a rollout setting"):
        rollout_setting(hostvars, ["a"], "serial", REPO_ROLES)
