"""A vLLM base's descriptor read as rules (module_utils/ddtree_base.py): every bad field is refused with a
sentence naming the file and the field, a missing base names the ones there are."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from ansible.module_utils.ddtree_base import BaseError, NoBaseError, load_rules, release_of, releases, rules, rules_for

GOOD = {
    "format": 1,
    "release": "1.2.3",
    "tree_state": {"layers": ["linear_attention"], "conv_width": 4},
    "scheduler": {"draft_slots_per_sequence": {"verified_tokens_plus": -1}},
    "cudagraphs": {
        "tokens_per_request": {"verified_tokens_plus": 1},
        "max_sizes": 512,
        "capture_size": {
            "min_requests": 1,
            "grid": {"sizes": [1, 2, 4], "steps": [{"from": 8, "every": 8}, {"from": 256, "every": 16}]},
        },
    },
    "kv_layout": {
        "block_tokens_multiple": 16,
        "state_slots_per_request": {"verified_tokens_plus": 1},
        "conv_columns": {"width_plus_verified_tokens_plus": -1},
        "group_merge_ratio": 1.5,
    },
}


def write(home: Path, release: str, data: object) -> Path:
    folder = home / f"vllm-{release}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "base.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_good_descriptor_reads_as_its_rules() -> None:
    base = rules(GOOD)
    assert (base.release, base.tree_layers, base.conv_width) == ("1.2.3", ("linear_attention",), 4)
    assert base.max_graph_sizes == 512
    assert (base.draft_slots(64), base.graph_tokens(64), base.capture_tokens(64)) == (63, 65, 65)
    # A cap must hold 65 tokens once cut down to the grid: 72 is the smallest grid size that does.
    assert base.min_capture_size(64) == 72
    assert (base.kv_block_multiple, base.state_slots(64), base.conv_columns(4, 64)) == (16, 65, 67)
    # Layer counts within 1.5x of each other share the largest's group size; further apart, the smallest's.
    assert (base.group_size([16, 5, 48]), base.group_size([36, 36]), base.group_size([10, 14])) == (5, 36, 14)


def test_the_capture_grid_cuts_down_and_rounds_up_as_written() -> None:
    """The grid 1, 2, 4, every 8 from 8 below 256, every 16 from 256 (vLLM 0.20.1's), written out."""
    base = rules(GOOD)
    assert base.grid_words() == "1, 2, 4, then every 8 from 8 and every 16 from 256"
    under = {0: 0, 1: 1, 3: 2, 7: 4, 8: 8, 15: 8, 255: 248, 256: 256, 271: 256, 520: 512, 10**9: 10**9}
    assert {size: base.grid_at_or_under(size) for size in under} == under
    above = {1: 1, 3: 4, 5: 8, 9: 16, 249: 256, 256: 256, 257: 272, 495: 496, 10**9 + 1: 10**9 + 16}
    assert {size: base.grid_at_or_above(size) for size in above} == above
    # One size per budget: 9 tokens (budget 8) and 15 (budget 14) are off the grid, 16 is on it.
    assert (base.min_capture_size(8), base.min_capture_size(14), base.min_capture_size(15)) == (16, 16, 16)
    # A grid of steps only, and a base that needs no requests' tokens at all.
    steps_only = copy.deepcopy(GOOD)
    steps_only["cudagraphs"]["capture_size"] = {
        "min_requests": 0,
        "grid": {"sizes": [], "steps": [{"from": 5, "every": 5}]},
    }
    base = rules(steps_only)
    assert (base.grid_words(), base.grid_at_or_under(4), base.grid_at_or_above(6)) == ("every 5 from 5", 0, 10)
    assert base.min_capture_size(64) == 0


def _with(path: str, value: object) -> dict:
    data = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("format", 2, "base.json: format is 2; this project reads format 1"),
        ("release", "1.2", "base.json: release is '1.2'; it must be a vLLM release number such as 0.20.1"),
        ("tree_state.layers", "linear_attention", "tree_state.layers is 'linear_attention'; it must be a list"),
        ("tree_state.conv_width", True, "tree_state.conv_width is True; it must be a whole number from 1 to 64"),
        (
            "scheduler.draft_slots_per_sequence",
            "verified_tokens - 1",
            "base.json has no scheduler.draft_slots_per_sequence.verified_tokens_plus; add it",
        ),
        (
            "cudagraphs.tokens_per_request.verified_tokens_plus",
            0,
            "verified_tokens_plus is 0; it must be a whole number from 1",
        ),
        ("cudagraphs.max_sizes", KeyError, "base.json has no cudagraphs.max_sizes; add it"),
        ("cudagraphs.max_sizes", 1e400, "cudagraphs.max_sizes is inf; it must be a whole number"),
        ("cudagraphs.capture_size", KeyError, "base.json has no cudagraphs.capture_size.min_requests; add it"),
        ("cudagraphs.capture_size.min_requests", -1, "min_requests is -1; it must be a whole number from 0 to 64"),
        ("cudagraphs.capture_size.grid", KeyError, "base.json has no cudagraphs.capture_size.grid.sizes; add it"),
        (
            "cudagraphs.capture_size.grid.sizes",
            [4, 2],
            "grid.sizes is [4, 2]; it must be a list of at most 64 ascending",
        ),
        ("cudagraphs.capture_size.grid.sizes", [0], "grid.sizes is [0]; it must be a list of at most 64 ascending"),
        ("cudagraphs.capture_size.grid.sizes", [True], "grid.sizes is [True]; it must be a list"),
        ("cudagraphs.capture_size.grid.steps", [], "grid.steps is []; it must be a list of 1 to 64 steps"),
        ("cudagraphs.capture_size.grid.steps", [{"from": 8}], "grid.steps is [{'from': 8}]; it must be a list"),
        ("cudagraphs.capture_size.grid.steps", [{"from": 8, "every": 0}], "it must be a list of 1 to 64 steps"),
        (
            "cudagraphs.capture_size.grid.steps",
            [{"from": 4, "every": 4}],
            "grid.steps start at [4]; each must start above the sizes and the step before it",
        ),
        (
            "cudagraphs.capture_size.grid.steps",
            [{"from": 256, "every": 16}, {"from": 8, "every": 8}],
            "grid.steps start at [256, 8]; each must start above the sizes and the step before it",
        ),
        ("kv_layout", KeyError, "base.json has no kv_layout.block_tokens_multiple; add it"),
        ("kv_layout.block_tokens_multiple", 0, "block_tokens_multiple is 0; it must be a whole number from 1 to 4096"),
        (
            "kv_layout.state_slots_per_request.verified_tokens_plus",
            "1",
            "verified_tokens_plus is '1'; it must be a whole number from 0 to 64",
        ),
        ("kv_layout.conv_columns", {"width_plus": -1}, "no kv_layout.conv_columns.width_plus_verified_tokens_plus"),
        ("kv_layout.group_merge_ratio", 0.5, "group_merge_ratio is 0.5; it must be a number from 1 to 16"),
        ("kv_layout.group_merge_ratio", True, "group_merge_ratio is True; it must be a number from 1 to 16"),
        ("kv_layout.group_merge_ratio", 1e400, "group_merge_ratio is inf; it must be a number from 1 to 16"),
    ],
)
def test_a_bad_field_is_named(path: str, value: object, message: str) -> None:
    with pytest.raises(BaseError) as caught:
        rules(_with(path, value))
    assert message in str(caught.value)


def test_bases_on_disk(tmp_path: Path) -> None:
    write(tmp_path, "1.2.3", GOOD)
    write(tmp_path, "1.10.0", {**GOOD, "release": "1.10.0"})
    write(tmp_path, "next", GOOD)  # not a release: no base
    assert releases(tmp_path) == ["1.2.3", "1.10.0"]
    assert load_rules(tmp_path, "1.10.0+cu130").release == "1.10.0"
    assert release_of(" 0.20.1+cu130 ") == "0.20.1"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "is not valid JSON"),
        ("[1]", "holds list, not a JSON object"),
        (json.dumps({**GOOD, "release": "1.2.4"}), "says release 1.2.4, not 1.2.3; fix the descriptor"),
    ],
)
def test_a_broken_file_is_named(tmp_path: Path, content: str, message: str) -> None:
    path = write(tmp_path, "1.2.3", content)
    with pytest.raises(BaseError) as caught:
        load_rules(tmp_path, "1.2.3")
    assert str(path) in str(caught.value)
    assert message in str(caught.value)


def test_no_base_names_the_ones_there_are(tmp_path: Path) -> None:
    write(tmp_path, "1.2.3", GOOD)
    with pytest.raises(
        NoBaseError, match=r"no base for vLLM 2\.0\.0 \(.*vllm-2\.0\.0/base\.json does not exist; bases: 1\.2\.3\)"
    ):
        load_rules(tmp_path, "2.0.0")
    with pytest.raises(BaseError, match=r"has 0 bases \(none\): name the vLLM release"):
        load_rules(tmp_path / "empty")


def test_a_release_without_a_base_gets_no_rules_never_another_base_s(tmp_path: Path) -> None:
    """rules_for answers which base's rules apply: the release's own, else none (one base or two beside it)."""
    write(tmp_path, "1.2.3", GOOD)
    assert rules_for(tmp_path, "2.0.0") is None
    assert rules_for(tmp_path, "1.2.3+cu130").release == "1.2.3"
    assert rules_for(tmp_path, None).release == "1.2.3"  # no release named: the sole base
    write(tmp_path, "1.10.0", {**GOOD, "release": "1.10.0"})
    assert rules_for(tmp_path, "2.0.0") is None
    assert rules_for(tmp_path, "1.10.0").release == "1.10.0"
    with pytest.raises(BaseError, match=r"has 2 bases \(1\.2\.3, 1\.10\.0\): name the vLLM release"):
        rules_for(tmp_path, "")
    write(tmp_path, "3.0.0", "{")  # a descriptor that is there but broken is an error, not "no base"
    with pytest.raises(BaseError, match="is not valid JSON"):
        rules_for(tmp_path, "3.0.0")
    assert rules_for(None, "0.20.1").release == "0.20.1"
