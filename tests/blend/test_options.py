"""Blend settings: r per model and namespace with its precedence, the tuner's knobs in the node's
option table, and bad values refused at start-up naming the option and the entry."""

from __future__ import annotations

import dataclasses

import pytest

from worker.dataplane.blend.options import (
    BlendError,
    BlendOptions,
    parse_model_percents,
    parse_namespace_percents,
)
from worker.dataplane.config import ConfigError, load_config

FLEET = BlendOptions(
    enabled=True,
    recompute_percent=15,
    namespace_percent=parse_namespace_percents("llama-8b/tenant-a=20, tenant-a=25, tenant-b=5, qwen-7b/tenant-b=40"),
    model_percent=parse_model_percents("llama-8b=10, qwen-7b=30"),
)


@pytest.mark.parametrize(
    ("model", "namespace", "percent", "why"),
    [
        ("llama-8b", "tenant-a", 20.0, "model/namespace entry first"),
        ("qwen-7b", "tenant-a", 25.0, "then the namespace entry"),
        ("llama-8b", "tenant-b", 5.0, "the namespace entry beats the model entry"),
        ("qwen-7b", "tenant-b", 40.0, "another model's own entry for that namespace"),
        ("llama-8b", "tenant-c", 10.0, "then the model entry"),
        ("qwen-7b", "tenant-c", 30.0, "each model its own"),
        ("mistral-7b", "tenant-c", 15.0, "then the default"),
        ("mistral-7b", "tenant-a", 25.0, "a model without entries still takes namespace entries"),
    ],
)
def test_r_precedence(model, namespace, percent, why):
    assert FLEET.percent_for(namespace, model) == percent, why


def test_a_node_knows_the_namespaces_configured_for_its_model_only():
    assert FLEET.configured_namespaces("llama-8b") == ["tenant-a", "tenant-b"]
    assert FLEET.configured_namespaces("mistral-7b") == ["tenant-a", "tenant-b"]
    only_other = BlendOptions(namespace_percent={"qwen-7b/rag": 30})
    assert only_other.configured_namespaces("llama-8b") == []
    assert only_other.configured_namespaces("qwen-7b") == ["rag"]
    assert FLEET.model_default("llama-8b") == 10.0 and FLEET.model_default("mistral-7b") == 15.0


@pytest.mark.parametrize(
    ("parse", "value", "message"),
    [
        (parse_namespace_percents, "rag", r"blend_namespace_percent: expected namespace=percent pairs"),
        (parse_namespace_percents, "rag=ten", r"blend_namespace_percent: 'ten' of rag is not a number"),
        (parse_namespace_percents, "rag=120", r"blend_namespace_percent\[rag\]: must be between 0 and 100"),
        (parse_namespace_percents, "llama-8b/rag=-1", r"blend_namespace_percent\[llama-8b/rag\]: must be between"),
        (
            parse_namespace_percents,
            "llama 8b/rag=5",
            r"blend_namespace_percent: 'llama 8b' of 'llama 8b/rag' is not a model",
        ),
        (
            parse_namespace_percents,
            "llama/-rag=5",
            r"blend_namespace_percent: '-rag' of 'llama/-rag' is not a namespace",
        ),
        (parse_namespace_percents, "/rag=5", r"blend_namespace_percent: '' of '/rag' is not a model"),
        (parse_namespace_percents, "rag=5,rag=6", r"blend_namespace_percent: rag is given twice"),
        (parse_model_percents, "llama-8b", r"blend_model_percent: expected model=percent pairs"),
        (parse_model_percents, "llama-8b=101", r"blend_model_percent\[llama-8b\]: must be between 0 and 100"),
        (parse_model_percents, "a/b=5", r"blend_model_percent: 'a/b' is not a model name"),
    ],
)
def test_bad_percent_maps_name_the_entry(parse, value, message):
    with pytest.raises(BlendError, match=message):
        parse(value)


def test_percent_maps_from_yaml_mappings(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text(
        "blend: true\nblend_namespace_percent:\n  llama-8b/tenant-a: 20\n  tenant-b: 5\n"
        "blend_model_percent:\n  llama-8b: 10\nblend_selection: chunk-start\nblend_reprobe_seconds: 30\n"
    )
    options = BlendOptions.from_config(load_config(environ={}, yaml_path=path))
    assert options.namespace_percent == {"llama-8b/tenant-a": 20.0, "tenant-b": 5.0}
    assert options.model_percent == {"llama-8b": 10.0}
    assert options.selection == "chunk-start" and options.reprobe_seconds == 30.0
    assert options.percent_for("tenant-c", "llama-8b") == 10.0


# Every knob of the tuner is a typed option: (variable, value, BlendOptions field, parsed value).
KNOBS = [
    ("STRATA_BLEND_RECOMPUTE_PERCENT", "25", "recompute_percent", 25.0),
    (
        "STRATA_BLEND_NAMESPACE_PERCENT",
        "llama-8b/rag=20,chat=5",
        "namespace_percent",
        {"llama-8b/rag": 20.0, "chat": 5.0},
    ),
    ("STRATA_BLEND_MODEL_PERCENT", "llama-8b=10", "model_percent", {"llama-8b": 10.0}),
    ("STRATA_BLEND_SELECTION", "chunk-start", "selection", "chunk-start"),
    ("STRATA_BLEND_CHECK_LAYER", "3", "check_layer", 3),
    ("STRATA_BLEND_SAMPLE_RATE", "0.2", "sample_rate", 0.2),
    ("STRATA_BLEND_AGREEMENT_THRESHOLD", "0.8", "agreement_threshold", 0.8),
    ("STRATA_BLEND_MAX_KL", "0.5", "max_kl", 0.5),
    ("STRATA_BLEND_MIN_SAMPLES", "40", "min_samples", 40),
    ("STRATA_BLEND_RAISE_STEP_PERCENT", "5", "raise_step_percent", 5.0),
    ("STRATA_BLEND_MAX_PERCENT", "80", "max_percent", 80.0),
    ("STRATA_BLEND_MIN_FRAGMENT_BLOCKS", "2", "min_fragment_blocks", 2),
    ("STRATA_BLEND_REPROBE_SECONDS", "0", "reprobe_seconds", 0.0),
]


@pytest.mark.parametrize(("variable", "value", "field", "parsed"), KNOBS)
def test_every_tuner_knob_is_a_node_option(variable, value, field, parsed):
    options = BlendOptions.from_config(load_config(environ={"STRATA_BLEND": "true", variable: value}))
    assert getattr(options, field) == parsed


def test_option_defaults_are_the_blend_defaults():
    assert BlendOptions.from_config(load_config(environ={})) == BlendOptions()


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("STRATA_BLEND_NAMESPACE_PERCENT", "llama-8b/rag=150", r"blend_namespace_percent\[llama-8b/rag\]: must be"),
        ("STRATA_BLEND_NAMESPACE_PERCENT", "llama-8b/=5", r"'' of 'llama-8b/' is not a namespace name"),
        ("STRATA_BLEND_MODEL_PERCENT", "llama-8b=-5", r"blend_model_percent\[llama-8b\]: must be between"),
        ("STRATA_BLEND_SELECTION", "random", "expected one of deviation, chunk-start, got 'random'"),
        ("STRATA_BLEND_CHECK_LAYER", "0", "must be at least 1"),
        ("STRATA_BLEND_CHECK_LAYER", "first", "invalid literal"),
        ("STRATA_BLEND_MAX_KL", "-0.1", "cannot be negative"),
        ("STRATA_BLEND_MIN_SAMPLES", "0", "must be at least 1"),
        ("STRATA_BLEND_RAISE_STEP_PERCENT", "0", "must be more than 0 and at most 100 percent"),
        ("STRATA_BLEND_MAX_PERCENT", "120", "must be between 0 and 100 percent"),
        ("STRATA_BLEND_MIN_FRAGMENT_BLOCKS", "0", "must be at least 1"),
        ("STRATA_BLEND_REPROBE_SECONDS", "-1", "cannot be negative"),
        ("STRATA_BLEND_REPROBE_SECONDS", "soon", "could not convert"),
    ],
)
def test_bad_blend_options_stop_the_start_naming_the_option(variable, value, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(environ={variable: value})
    assert str(caught.value).startswith(f"{variable}: ")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model_percent": {"llama-8b": 101}}, "model_percent[llama-8b]"),
        ({"model_percent": {"a b": 5}}, "model_percent"),
        ({"namespace_percent": {"llama-8b/-x": 5}}, "namespace_percent"),
        ({"raise_step_percent": 0}, "raise_step_percent"),
        ({"reprobe_seconds": -1}, "reprobe_seconds"),
    ],
)
def test_bad_blend_options_built_in_code_name_the_field(kwargs, field):
    with pytest.raises(BlendError) as caught:
        dataclasses.replace(BlendOptions(), **kwargs)
    assert caught.value.field == field
