"""The blend quality task on the model vLLM serves: selective recompute over vLLM's own modules
(`worker.dataplane.connectors.vllm.blend_model`), run inside vLLM's worker by `LLM.apply_model`.

`quality_in_vllm` is `benchmarks.models.blend.quality_report` with vLLM's loaded model in place of
the transformers one: the corpus is read in groups of passages (so each passage's KV is computed
after other passages, as a RAG client's first requests would), each passage's KV kept as one
fragment block at the position it was computed at; then every question is answered by a full
prefill, by the fragments fused with nothing recomputed (`fused`), and by deviation selection at
each r, all through vLLM's weights and kernels. What it does not exercise is vLLM's serving path
(its scheduler, its pages): it measures the layer loop's quality on vLLM's model.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.models.blend import BOS, QUERY, SELECTION_PREFIX, kl_divergence, make_question, task_questions


def _prefill(shim: Any, prompt: Sequence[int], *, device: torch.device) -> Any:
    """A full prefill through the selective-recompute loop (no fragments): every token computed."""
    from worker.dataplane.blend.fusion import BlendPlan, blend_prefill  # noqa: PLC0415

    empty = _empty_blocks(shim, device)
    return blend_prefill(shim, prompt, BlendPlan(0, [], 1.0), lambda _layer: (empty, empty), device=device)


def _empty_blocks(shim: Any, device: torch.device) -> torch.Tensor:
    attn = shim.model.layers[0].self_attn.attn
    heads = attn.kv_size // attn.head_dim
    dtype = next(shim.vllm_model.parameters()).dtype
    return torch.empty(0, 2, 1, heads, attn.head_dim, dtype=dtype, device=device)


def quality_in_vllm(
    model: Any,
    *,
    task: str = "multihop",
    questions: int = 100,
    passages: int = 8,
    percents: Sequence[float] = (0.0, 15.0),
    selection: str = "deviation",
    seed: int = 11,
    check_layer: int = 1,
) -> dict[str, Any]:
    """Accuracy and KL against full prefill per variant (full, fused, `<selection>_r<p>`), and per
    question its prompt and the full prefill's top-5 logprobs (for the caller to compare with vLLM's
    own answer to the same prompt)."""
    from worker.dataplane.blend.fusion import BlendPlan, blend_prefill  # noqa: PLC0415
    from worker.dataplane.blend.matching import Fragment  # noqa: PLC0415
    from worker.dataplane.connectors.vllm.blend_model import VllmBlendModel  # noqa: PLC0415

    shim = VllmBlendModel(model)
    device = next(model.parameters()).device
    layers = len(shim.model.layers)
    rng = random.Random(seed)
    corpus, draw = task_questions(task, passages=passages, seed=seed)
    empty = _empty_blocks(shim, device)
    stored: dict[tuple[int, ...], tuple[int, list[torch.Tensor]]] = {}
    """A passage's tokens -> where its KV was computed, and that KV per layer `[2, tokens, heads, dim]`."""
    with torch.inference_mode():
        for first in range(0, len(corpus), passages):
            segments, prompt = [], [BOS]
            for passage in corpus[first : first + passages]:
                segments.append((len(prompt), len(prompt) + len(passage.tokens)))
                prompt += passage.tokens
            # As quality_report warms: the lookup task with a question drawn, the multi-hop one with QUERY.
            prompt = (
                make_question(rng, corpus[first : first + passages]).prompt if task == "lookup" else [*prompt, QUERY]
            )
            cache = _prefill(shim, prompt, device=device).cache
            for start, end in segments:
                kv = []
                for layer in range(layers):
                    keys, values = cache.layer_kv(layer)
                    kv.append(
                        torch.stack([keys[0, :, start:end].transpose(0, 1), values[0, :, start:end].transpose(0, 1)])
                    )
                stored[tuple(prompt[start:end])] = (start, kv)
        variants = ["full", "fused", *[f"{SELECTION_PREFIX[selection]}_r{p:g}" for p in percents]]
        right = dict.fromkeys(variants, 0)
        kl = dict.fromkeys(variants, 0.0)
        answers: list[tuple[list[int], list[tuple[int, float]]]] = []
        """Each question's prompt and the full prefill's five likeliest next tokens with their logprobs."""
        for _ in range(questions):
            q = draw(rng)
            fragments, blocks = [], []
            for start, end in q.segments:
                found = stored.get(tuple(q.prompt[start:end]))
                if found is not None:
                    source, kv = found
                    fragments.append(Fragment(start, end - start, uuid.uuid4(), source, "host"))
                    blocks.append(kv)

            def source(layer: int, blocks: list[list[torch.Tensor]] = blocks) -> tuple[torch.Tensor, torch.Tensor]:
                return empty, torch.stack([kv[layer] for kv in blocks]) if blocks else empty

            full = _prefill(shim, q.prompt, device=device).logits
            runs = {"full": full}
            runs["fused"] = blend_prefill(
                shim, q.prompt, BlendPlan(0, fragments, 0.0, selection="chunk-start"), source, device=device
            ).logits
            for percent in percents:
                plan = BlendPlan(0, fragments, percent / 100, selection=selection, check_layer=check_layer)
                runs[f"{SELECTION_PREFIX[selection]}_r{percent:g}"] = blend_prefill(
                    shim, q.prompt, plan, source, device=device
                ).logits
            for name, logits in runs.items():
                right[name] += int(torch.argmax(logits)) == q.answer
                kl[name] += kl_divergence(full, logits)
            top = torch.topk(torch.log_softmax(full.float(), dim=-1), 5)
            answers.append((list(q.prompt), list(zip(top.indices.tolist(), top.values.tolist(), strict=True))))
    return {
        "report": {name: {"accuracy": right[name] / questions, "kl": kl[name] / questions} for name in variants},
        "answers": answers,
    }
