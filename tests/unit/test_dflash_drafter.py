"""DFlash drafter config inference: published shapes give the published values; every refusal refuses."""

from __future__ import annotations

import json
import os
import re

import pytest
from ansible.module_utils.dflash_drafter import (
    DFlashConfigError,
    build_config,
    find_mask_token_id,
    generate,
    infer_drafter,
    read_target,
    target_layer_ids_rule,
)
from ansible.module_utils.safetensors_header import inspect_path
from safetensors_files import QWEN3_8B_DFLASH, QWEN36_27B_DFLASH, dflash_shapes, fake, write_real, write_sparse

SLIDING4_FULL1 = ["sliding_attention"] * 4 + ["full_attention"]

QWEN36_27B_DFLASH_CONFIG = """{
  "architectures": [
    "DFlashDraftModel"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "block_size": 16,
  "dflash_config": {
    "mask_token_id": 248070,
    "target_layer_ids": [
      1,
      16,
      31,
      46,
      61
    ]
  },
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 5120,
  "initializer_range": 0.02,
  "intermediate_size": 17408,
  "layer_types": [
    "sliding_attention",
    "sliding_attention",
    "sliding_attention",
    "sliding_attention",
    "full_attention"
  ],
  "max_position_embeddings": 262144,
  "model_type": "qwen3",
  "num_attention_heads": 32,
  "num_hidden_layers": 5,
  "num_key_value_heads": 8,
  "num_target_layers": 64,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 10000000,
  "sliding_window": 2048,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "use_cache": true,
  "use_sliding_window": true,
  "vocab_size": 248320
}
"""

targets = fake("target_configs")


def refuses(text):
    """Expect a refusal whose message contains ``text`` literally."""
    return pytest.raises(DFlashConfigError, match=re.escape(text))


def tensors_of(path):
    return {n: (t.dtype, t.shape) for n, t in inspect_path(str(path)).tensors.items()}


@pytest.fixture(scope="module")
def qwen36(tmp_path_factory):
    d = tmp_path_factory.mktemp("q36")
    drafter = write_sparse(d / "model.safetensors", QWEN36_27B_DFLASH)
    target = targets.qwen36_27b(d / "target")
    return tensors_of(drafter), str(target)


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory):
    d = tmp_path_factory.mktemp("q3")
    drafter = write_sparse(d / "model.safetensors", QWEN3_8B_DFLASH)
    target = targets.qwen3_8b(d / "target")
    return tensors_of(drafter), str(target)


def test_qwen36_27b_dflash_gives_the_published_config(qwen36):
    tensors, target = qwen36
    text, _, report = generate(tensors, target, layer_types=SLIDING4_FULL1, sliding_window=2048)
    assert text == QWEN36_27B_DFLASH_CONFIG
    assert report["published_match"] == "Qwen3.6-27B-DFlash"
    assert report["mask_token_id_source"] == (
        "first id past the target tokenizer's tokens (tokenizer.json + tokenizer_config.json)"
    )
    assert report["target_layer_ids_source"] == "DFlash default rule for 64 target layers and 5 draft layers"
    assert report["drafter"] == {
        "hidden_size": 5120,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 17408,
        "attention_bias": False,
        "dtype": "BF16",
        "num_tapped_layers": 5,
        "parameters": 1730213120,
    }
    assert report["target"] == {
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "vocab_size": 248320,
        "model_type": "qwen3_5",
        "text_config": True,
    }
    assert report["assumptions"] == []


def test_qwen36_shapes_without_layer_types_refuse_to_guess(qwen36):
    tensors, target = qwen36
    with pytest.raises(DFlashConfigError) as exc:
        generate(tensors, target)
    assert str(exc.value) == (
        "the drafter's shapes match several published drafters that differ in their attention layer"
        " pattern, which shapes cannot tell: Qwen3.6-27B-DFlash: layer_types ['sliding_attention',"
        " 'sliding_attention', 'sliding_attention', 'sliding_attention', 'full_attention'],"
        " sliding_window 2048; Qwen3.5-27B-DFlash: all 5 layers full_attention. Set layer_types (and"
        " sliding_window) to the pattern of the drafter you staged"
    )


def test_same_shapes_all_full_is_the_qwen35_drafter(qwen36):
    tensors, target = qwen36
    _, config, report = generate(tensors, target, layer_types=["full_attention"] * 5)
    assert report["published_match"] == "Qwen3.5-27B-DFlash"
    assert config["layer_types"] == ["full_attention"] * 5
    assert config["use_sliding_window"] is False
    assert "sliding_window" not in config


def test_qwen3_8b_dflash_b16_gives_the_published_values(qwen3_8b):
    tensors, target = qwen3_8b
    _, config, report = generate(tensors, target)
    assert config == {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 151936,
    }
    assert report["published_match"] == "Qwen3-8B-DFlash-b16"
    assert report["assumptions"] == [
        "all layers full attention, as Qwen3-8B-DFlash-b16 (the only published drafter with these shapes)"
    ]


@pytest.mark.parametrize(
    ("n", "k", "ids"),
    [
        (64, 5, [1, 16, 31, 46, 61]),
        (36, 5, [1, 9, 17, 25, 33]),
        (64, 1, [32]),
        (37, 1, [18]),
        (12, 3, [1, 5, 9]),
        # (N-4)/(k-1) = 1.5: 2.5 rounds to 2 (even), 5.5 rounds to 6 (even); half-up would give [1,3,4,6,7]
        (10, 5, [1, 2, 4, 6, 7]),
        (7, 3, [1, 2, 4]),
    ],
)
def test_target_layer_ids_rule(n, k, ids):
    assert target_layer_ids_rule(n, k) == ids


def test_tiny_real_drafter_written_by_safetensors(tmp_path):
    path = write_real(tmp_path / "d.safetensors", dflash_shapes(64, 2, 4, 2, 16, 128, 2))
    target = targets.tiny(tmp_path / "t")
    _, config, report = generate(tensors_of(path), str(target))
    assert config["torch_dtype"] == "float16"
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 16
    assert config["intermediate_size"] == 128
    assert config["dflash_config"] == {"mask_token_id": 990, "target_layer_ids": [1, 5]}
    assert config["attention_bias"] is False
    assert report["published_match"] is None
    assert report["assumptions"] == ["all layers full attention (layer_types not given; shapes cannot tell)"]


def test_attention_bias_is_inferred(tmp_path):
    path = write_real(tmp_path / "d.safetensors", dflash_shapes(64, 2, 4, 2, 16, 128, 2, bias=True))
    _, config, _ = generate(tensors_of(path), str(targets.tiny(tmp_path / "t")))
    assert config["attention_bias"] is True


def test_given_values_override(tmp_path):
    path = write_real(tmp_path / "d.safetensors", dflash_shapes(64, 2, 4, 2, 16, 128, 3))
    target = targets.tiny(tmp_path / "t")
    _, config, report = generate(
        tensors_of(path),
        str(target),
        block_size=8,
        mask_token_id=999,
        target_layer_ids=[0, 3, 7],
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
    )
    assert config["block_size"] == 8
    assert config["dflash_config"] == {"mask_token_id": 999, "target_layer_ids": [0, 3, 7]}
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == 64
    assert report["mask_token_id_source"] == "given"
    assert report["target_layer_ids_source"] == "given"


def test_mask_id_from_vocab_json_and_tokenizer_config(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "c": 2}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"3": {}, "4": {}}}))
    assert find_mask_token_id(str(tmp_path)) == (5, "vocab.json + tokenizer_config.json")


def test_mask_id_counts_added_tokens_of_every_source(tmp_path):
    targets.tiny(tmp_path, tokens=100)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"150": {}}}))
    assert find_mask_token_id(str(tmp_path)) == (151, "tokenizer.json + tokenizer_config.json")


def test_read_target_flat_and_nested(tmp_path):
    nested = read_target(str(targets.qwen36_27b(tmp_path / "a")))
    assert (nested.hidden_size, nested.num_hidden_layers, nested.vocab_size) == (5120, 64, 248320)
    assert nested.rope_theta == 10000000
    assert nested.rope_scaling is None
    assert nested.nested_text_config is True
    flat = read_target(str(targets.tiny(tmp_path / "b")))
    assert (flat.hidden_size, flat.num_hidden_layers, flat.nested_text_config) == (64, 8, False)


def test_rope_scaling_from_rope_parameters(tmp_path):
    cfg = json.loads(json.dumps(targets.QWEN36_27B_CONFIG))
    cfg["text_config"]["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000000,
        "factor": 4.0,
        "original_max_position_embeddings": 262144,
        "mrope_section": [11, 11, 10],
    }
    targets.write_target(tmp_path, cfg, None)
    t = read_target(str(tmp_path))
    assert t.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}


# --- refusals (the pure layer; the module tests prove nothing is written) ---


def _tiny(tmp_path, **shape_kw):
    kw = {"hidden": 64, "layers": 2, "heads": 4, "kv": 2, "head_dim": 16, "inter": 128, "taps": 2}
    kw.update(shape_kw)
    return {n: ("F16", s) for n, s in dflash_shapes(**kw).items()}


def test_refuse_hidden_size_differs_from_target(tmp_path):
    target = targets.tiny(tmp_path, hidden=96)
    with refuses("the drafter's hidden size 64 differs from the target's 96"):
        generate(_tiny(tmp_path), str(target))


def test_refuse_fc_width_not_multiple(tmp_path):
    t = _tiny(tmp_path)
    t["fc.weight"] = ("F16", (64, 100))
    with refuses("its width 100 is not a multiple of the hidden size 64"):
        infer_drafter(t)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("norm.weight"), "the drafter lacks norm.weight"),
        (
            lambda t: t.pop("layers.1.mlp.up_proj.weight"),
            "drafter tensors missing: layers.1.mlp.up_proj.weight",
        ),
        (lambda t: t.update({"layers.3.mlp.up_proj.weight": ("F16", (128, 64))}), r"layers \[2\] absent"),
        (
            lambda t: t.update({"layers.1.self_attn.k_proj.weight": ("F16", (48, 64))}),
            r"inconsistent shapes: layers.1.self_attn.k_proj.weight is \[48, 64\], expected \[32, 64\]",
        ),
        (
            lambda t: t.update({"hidden_norm.weight": ("F16", (32,))}),
            "inconsistent shapes: hidden_norm.weight",
        ),
        (
            lambda t: t.update({"model.embed_tokens.weight": ("F16", (1000, 64))}),
            "DFlash layout does not have",
        ),
        (
            lambda t: t.update({"layers.1.self_attn.q_proj.bias": ("F16", (64,))}),
            "layers.0 has no attention biases",
        ),
        (lambda t: t.update({"fc.weight": ("I8", (64, 128))}), "drafter weights are I8"),
        (lambda t: t.update({"lm_head.weight": ("F16", (999, 64))}), r"lm_head.weight is \[999, 64\]"),
    ],
)
def test_refuse_missing_or_inconsistent_tensors(tmp_path, edit, message):
    t = _tiny(tmp_path)
    edit(t)
    with pytest.raises(DFlashConfigError, match=message):
        infer_drafter(t, target_vocab=1000)


def test_refuse_no_dflash_tensors_with_model_prefix():
    with refuses("start with 'model.'"):
        infer_drafter({"model.norm.weight": ("BF16", (8,))})


def test_refuse_mask_id_not_below_vocab(tmp_path):
    target = targets.tiny(tmp_path, vocab=1000)
    with pytest.raises(
        DFlashConfigError, match=r"mask token id 1000 \(given\) is not below the target's vocab_size 1000"
    ):
        generate(_tiny(tmp_path), str(target), mask_token_id=1000)


def test_refuse_tokenizer_larger_than_vocab(tmp_path):
    target = targets.tiny(tmp_path, vocab=1000, tokens=1000)
    with refuses("mask token id 1000 (first id past"):
        generate(_tiny(tmp_path), str(target))


def test_refuse_layer_id_outside_target(tmp_path):
    target = targets.tiny(tmp_path, layers=8)
    with pytest.raises(
        DFlashConfigError, match=r"target layer id\(s\) \[8\] outside the target, which has layers 0..7"
    ):
        generate(_tiny(tmp_path), str(target), target_layer_ids=[1, 8])


def test_refuse_rule_outside_target_for_tiny_target(tmp_path):
    target = targets.tiny(tmp_path, layers=2)
    with pytest.raises(DFlashConfigError, match=r"target layer id\(s\) \[-1\] outside the target"):
        generate(_tiny(tmp_path), str(target))


def test_refuse_default_rule_when_taps_differ_from_layers(tmp_path):
    target = targets.tiny(tmp_path)
    with refuses("fc.weight taps 3 target layers but the drafter has 2 draft layers"):
        generate(_tiny(tmp_path, taps=3), str(target))


def test_refuse_wrong_number_of_given_layer_ids(tmp_path):
    with refuses("target_layer_ids has 3 entries but fc.weight taps 2"):
        generate(_tiny(tmp_path), str(targets.tiny(tmp_path)), target_layer_ids=[1, 2, 3])


def test_refuse_no_way_to_find_mask_id(tmp_path):
    targets.write_target(tmp_path, json.loads((targets.tiny(tmp_path / "x") / "config.json").read_text()), None)
    (tmp_path / "vocab.json").write_text('{"a": 0}')
    with refuses("cannot find the mask token id:"):
        generate(_tiny(tmp_path), str(tmp_path))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries but the drafter has 2 layers"),
        ({"layer_types": ["full_attention", "local"]}, "may only hold"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "set sliding_window too"),
        ({"layer_types": ["full_attention"] * 2, "sliding_window": 8}, "no layer in layer_types is sliding"),
        ({"sliding_window": 8}, "sliding_window needs layer_types"),
        (
            {"layer_types": ["sliding_attention"] * 2, "sliding_window": 0},
            "sliding_window must be a positive",
        ),
        ({"block_size": 1}, "block_size must be an integer >= 2"),
    ],
)
def test_refuse_bad_settings(tmp_path, kw, message):
    with pytest.raises(DFlashConfigError, match=message):
        generate(_tiny(tmp_path), str(targets.tiny(tmp_path)), **kw)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[]", "is not a JSON object"),
        ('{"hidden_size": 64}', "has no usable num_hidden_layers"),
        (
            '{"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 9, "max_position_embeddings": 9}',
            "has no rope_theta",
        ),
    ],
)
def test_refuse_bad_target_config(tmp_path, config, message):
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(DFlashConfigError, match=message):
        read_target(str(tmp_path))


def test_refuse_missing_target_config(tmp_path):
    with refuses("config.json does not exist"):
        read_target(str(tmp_path))


def test_fuzz_random_drafter_shapes_never_traceback(tmp_path):
    """Seeded: drop, add and reshape tensors of a valid drafter; only refusals or a config, never a crash."""
    import random

    target = read_target(str(targets.tiny(tmp_path)))
    base = {n: ("F16", s) for n, s in dflash_shapes(64, 2, 4, 2, 16, 128, 2).items()}
    rng = random.Random(1130)
    names = sorted(base)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(2000):
        t = dict(base)
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(4)
            name = rng.choice(names)
            if op == 0:
                t.pop(name, None)
            elif op == 1:
                dims = [rng.choice([0, 1, 2, 16, 32, 64, 100, 128, 192]) for _ in range(rng.randint(0, 3))]
                t[name] = ("F16", tuple(dims))
            elif op == 2:
                t[f"layers.{rng.randint(0, 4)}.{name.split('.', 2)[-1]}"] = t.get(name, ("F16", (64,)))
            else:
                t[name] = (rng.choice(["F16", "BF16", "I8", "F32"]), t.get(name, ("F16", (1,)))[1])
        try:
            shape = infer_drafter(t, target_vocab=1000)
            build_config(shape, target, mask_token_id=990)
            outcomes["ok"] += 1
        except DFlashConfigError as exc:
            assert str(exc)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 1500
    assert outcomes["ok"] > 0


# ------------------------------------------------------------------ hostile inputs (issue 23, items 5, 8 and 9)


def test_a_huge_layer_index_is_refused_without_allocating(tmp_path):
    t = _tiny(tmp_path)
    t["layers.1000000000000.mlp.up_proj.weight"] = ("F16", (128, 64))
    with refuses("drafter tensor layers.1000000000000.mlp.up_proj.weight names layer 1000000000000 but the file"):
        infer_drafter(t, target_vocab=1000)
    t = _tiny(tmp_path)
    t["layers." + "9" * 4400 + ".x"] = ("F16", (1,))
    with refuses("names layer 99999999999999999999... (4400 digits) but the file has only"):
        infer_drafter(t, target_vocab=1000)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('"rope_theta": NaN', "is not valid JSON (NaN is not a JSON number"),
        # Past a float: refused where read, as Infinity is (issue 43), never turned into inf.
        ('"rope_theta": 1e400', "is not valid JSON (the number 1e400 is past what a float holds"),
        ('"rope_theta": 10000, "rms_norm_eps": -Infinity', "is not valid JSON (-Infinity is not a JSON number"),
        (
            '"rope_theta": 10000, "rms_norm_eps": 1e999',
            "is not valid JSON (the number 1e999 is past what a float holds",
        ),
    ],
)
def test_refuse_non_finite_numbers_in_the_target_config(tmp_path, extra, message):
    base = '"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 9, "max_position_embeddings": 9'
    (tmp_path / "config.json").write_text("{" + base + ", " + extra + "}")
    with refuses(message):
        read_target(str(tmp_path))


def test_rendered_config_is_strict_json():
    from ansible.module_utils.dflash_drafter import render

    with refuses("would hold a number that is not finite"):
        render({"rope_scaling": {"factor": float("inf")}})


def test_deeply_nested_or_oversized_target_files_are_named(tmp_path):
    (tmp_path / "config.json").write_text("[" * 50000 + "]" * 50000)
    with refuses(f"target config {tmp_path / 'config.json'} is nested 50000 levels deep"):
        read_target(str(tmp_path))
    (tmp_path / "config.json").unlink()
    os.mkfifo(tmp_path / "config.json")
    with refuses("config.json is not a regular file (a FIFO)"):
        read_target(str(tmp_path))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("tokenizer.json", {"model": {"vocab": {"a": 0}}, "added_tokens": 5}, "added_tokens is int, not a list"),
        ("tokenizer.json", {"model": {"vocab": {"a": 0}}, "added_tokens": True}, "added_tokens is bool, not a list"),
        ("tokenizer_config.json", {"added_tokens_decoder": {"\u0661\u0662": {}}}, "is not a token id"),
        ("tokenizer_config.json", {"added_tokens_decoder": {"\u00b2": {}}}, "is not a token id"),
        ("tokenizer_config.json", {"added_tokens_decoder": {"9" * 4301: {}}}, "is not a token id"),
    ],
)
def test_malformed_tokenizer_files_are_refused_not_raised(tmp_path, name, content, message):
    import json as _json

    from ansible.module_utils.dflash_drafter import find_mask_token_id

    (tmp_path / "tokenizer.json").write_text(_json.dumps({"model": {"vocab": {"a": 0}}}))
    (tmp_path / "vocab.json").write_text(_json.dumps({"a": 0}))
    (tmp_path / name).write_text(_json.dumps(content))
    with refuses(message):
        find_mask_token_id(str(tmp_path))
