"""A real vLLM refuses, at start, a model whose KV cache Strata cannot key and move exactly: the
`tiny-sliding` preset (sliding-window attention on every layer, whose out-of-window pages vLLM
gives up to its null page) stops the engine with one line naming the layer kind and the model."""

from __future__ import annotations

import time

import pytest

from tests.connectors.conftest import environment, host_only_transfer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_sliding_window_model_is_refused_at_start_naming_the_layer_kind_and_the_model(tmp_path, shm_name):
    from vllm import LLM

    from worker.dataplane.models.loading import save_preset

    checkpoint = save_preset("tiny-sliding", tmp_path / "tiny-sliding")
    transfer = host_only_transfer("sliding", shm_name)
    with environment({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}):
        with pytest.raises(Exception) as refused:
            LLM(
                model=str(checkpoint),
                dtype="float32",
                skip_tokenizer_init=True,
                max_model_len=512,
                block_size=32,
                num_gpu_blocks_override=32,
                kv_transfer_config=transfer,
            )
    chain, error = [], refused.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    message = next((m for m in chain if m.startswith("StrataConnector: model")), "\n".join(chain))
    assert "sliding-window attention layers" in message, message
    assert str(checkpoint) in message and "\n" not in message


def test_an_architecture_blending_does_not_serve_starts_with_blending_refused_in_one_line_and_reuses_prefixes(
    shm_name, caplog, monkeypatch
):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.blend.conftest import MULTIHOP_MODEL
    from worker.dataplane.connectors.vllm import blend_model

    # The Llama fixture (head_dim 32: vLLM's CPU kernels take it) as an architecture blending does
    # not serve: no other architecture is at hand without downloads.
    monkeypatch.setattr(blend_model, "ARCHITECTURES", frozenset({"Qwen2ForCausalLM"}))
    checkpoint = MULTIHOP_MODEL
    transfer = host_only_transfer("blending", shm_name, blend=True)
    with caplog.at_level("WARNING", logger="strata.vllm"):
        with environment({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}):
            llm = LLM(
                model=str(checkpoint),
                dtype="float32",
                skip_tokenizer_init=True,
                max_model_len=512,
                block_size=32,
                num_gpu_blocks_override=32,
                kv_transfer_config=transfer,
            )
    try:
        said = [r.getMessage() for r in caplog.records if "fragment reuse" in r.getMessage()]
        assert said == [
            "StrataConnector on node blending: fragment reuse refused (architecture LlamaForCausalLM: fragment "
            "blending serves Qwen2ForCausalLM); this node reuses prefixes only"
        ]
        # It serves, with prefix reuse: a prompt asked again after vLLM's own cache was flushed is a Strata hit.
        prompt = TokensPrompt(prompt_token_ids=list(range(1, 200)))
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        first = llm.generate([prompt], greedy, use_tqdm=False)[0]
        # The first answer's blocks are stored by the save queue's thread, outside the step: ask until they are.
        deadline = time.monotonic() + 30
        while True:
            assert llm.reset_prefix_cache()
            again = llm.generate([prompt], greedy, use_tqdm=False)[0]
            if (again.num_cached_tokens or 0) >= 64 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert (again.num_cached_tokens or 0) >= 64, again.num_cached_tokens  # at least a block from the host tier
    finally:
        llm.llm_engine.engine_core.shutdown()
