"""Selective recompute over the model vLLM serves (`blend_model.VllmBlendModel`): its rotary angles
are vLLM's, a full prefill through it answers as vLLM does, and on the trained multi-hop fixture
fusing fragments with nothing recomputed loses answers while the default r keeps them - all
computed by a real vLLM's worker on vLLM's own weights and kernels (`LLM.apply_model`)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.connectors.test_blend_vllm import engine as multihop_engine
from worker.dataplane.blend.options import BlendOptions
from worker.dataplane.blend.rope import rotate, rotation
from worker.dataplane.connectors.vllm.blend_model import VllmBlendModel, _Rotary, blend_problem

DEFAULT = BlendOptions()


def vllm_rope(head_dim: int = 64, theta: float = 10000.0, **parameters: Any) -> Any:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(
            head_dim,
            4096,
            is_neox_style=True,
            rope_parameters={"rope_type": "default", "rope_theta": theta, **parameters},
        )


@pytest.mark.parametrize(
    "parameters",
    [
        {},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        {"rope_type": "linear", "factor": 2.0},
    ],
    ids=["default", "llama3", "linear"],
)
def test_the_rotary_angles_are_vllms_own_and_a_shift_moves_a_key_exactly(parameters) -> None:
    rope = vllm_rope(**parameters)
    table = _Rotary(rope)
    torch.manual_seed(0)
    heads, dim, tokens = 2, 64, 40
    keys = torch.randn(tokens, heads * dim)
    positions = torch.arange(100, 100 + tokens)
    # vLLM's own rotation of keys at their positions...
    _, want = rope.forward_native(positions, keys.clone(), keys.clone())
    # ...and the angles blending applies (transformers' layout: [batch, heads, tokens, dim]).
    as_heads = keys.view(1, tokens, heads, dim).transpose(1, 2)
    cos, sin = table(as_heads, position_ids=positions.unsqueeze(0))
    got = rotate(as_heads, (cos.unsqueeze(1), sin.unsqueeze(1))).transpose(1, 2).reshape(tokens, heads * dim)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # A key rotated at 100+t, then shifted by -73 (earlier) and by +29, is the key rotated there.
    for shift in (-73, 29):
        moved = rotate(got.view(1, tokens, heads, dim).transpose(1, 2), rotation(table, torch.full((tokens,), shift)))
        _, there = rope.forward_native(positions + shift, keys.clone(), keys.clone())
        assert torch.allclose(moved.transpose(1, 2).reshape(tokens, heads * dim), there, atol=1e-4), shift


def test_a_rotary_embedding_that_is_not_a_rotation_is_refused_by_name() -> None:
    rope = vllm_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)

    class Attention:
        rotary_emb = rope
        head_dim = 64

    class Layer:
        self_attn = Attention()

    class Base:
        layers = [Layer()]

    class LlamaForCausalLM:
        model = Base()

    problem = blend_problem(LlamaForCausalLM(), vllm_version="0.32.0")
    assert problem is not None and "YaRNScalingRotaryEmbedding" in problem and "not a plain rotation" in problem
    assert "built for vLLM 0.32.x" in (blend_problem(LlamaForCausalLM(), vllm_version="0.33.1") or "")
    assert "pipeline parallel 2" in (
        blend_problem(LlamaForCausalLM(), vllm_version="0.32.0", pipeline_parallel=2) or ""
    )
    other = type("GPT2LMHeadModel", (), {})()
    assert "architecture GPT2LMHeadModel" in (blend_problem(other, vllm_version="0.32.0") or "")


@pytest.fixture(scope="module")
def multihop_vllm() -> Any:
    # In this process, as the fault test's engines: apply_model runs the function on the worker here.
    llm = multihop_engine()
    yield llm
    llm.llm_engine.engine_core.shutdown()


def served_model_kind(model: Any) -> tuple[str, str | None]:
    import vllm

    return type(model).__name__, blend_problem(model, vllm_version=vllm.__version__)


@pytest.fixture(scope="module")
def quality(multihop_vllm) -> dict[str, Any]:
    from benchmarks.models.blend_vllm import quality_in_vllm

    run = functools.partial(
        quality_in_vllm,
        task="multihop",
        questions=100,
        passages=8,
        percents=(0.0, DEFAULT.recompute_percent),
        selection=DEFAULT.selection,
        check_layer=DEFAULT.check_layer,
    )
    (result,) = multihop_vllm.apply_model(run)
    return result


def test_the_served_llama_is_blendable(multihop_vllm) -> None:
    assert multihop_vllm.apply_model(served_model_kind) == [("LlamaForCausalLM", None)]


def test_a_full_prefill_through_vllms_modules_answers_as_vllm_does(multihop_vllm, quality) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    asked = quality["answers"][:20]
    outputs = multihop_vllm.generate(
        [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in asked],
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
        use_tqdm=False,
    )
    worst = 0.0
    for (prompt, ours), output in zip(asked, outputs, strict=True):
        theirs = output.outputs[0].logprobs[0]
        assert output.outputs[0].token_ids[0] == ours[0][0], prompt
        for token, logprob in ours:
            worst = max(worst, abs(theirs[token].logprob - logprob) if token in theirs else float("inf"))
    # float32 on both sides; the layer loop's attention is torch's, vLLM's is its own CPU kernel.
    assert worst < 1e-3, worst


def test_fused_fragments_lose_answers_and_the_default_r_keeps_them(quality) -> None:
    report = quality["report"]
    full = report["full"]["accuracy"]
    default = report[f"blend_r{DEFAULT.recompute_percent:g}"]["accuracy"]
    assert full >= 0.95, report
    assert full - report["fused"]["accuracy"] >= 0.20, report  # nothing recomputed: answers lost
    assert full - default <= 0.02, report


def test_the_shim_refuses_nothing_it_maps(multihop_vllm) -> None:
    def layer_names(model: Any) -> list[str]:
        shim = VllmBlendModel(model)
        layer = shim.model.layers[0]
        return [type(layer.self_attn).__name__, type(shim.model.rotary_emb).__name__, str(len(shim.model.layers))]

    assert multihop_vllm.apply_model(layer_names) == [["_Attention", "_Rotary", "8"]]


def test_the_mlp_runs_its_activation_eagerly_and_computes_what_vllms_does(multihop_vllm) -> None:
    """The shim's MLP is vLLM's gate/up and down projections around the plain activation (vLLM's
    own activation op compiles on its first call outside the model's graph: seconds inside a step)."""

    def compare(model: Any) -> tuple[bool, float]:
        import torch

        shim = VllmBlendModel(model)
        layer, theirs = shim.model.layers[3].mlp, model.model.layers[3].mlp
        x = torch.randn(1, 37, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            return layer.act is not None, float((layer(x) - theirs(x[0])).abs().max())

    ((eager, gap),) = multihop_vllm.apply_model(compare)
    assert eager and gap < 1e-5, gap
