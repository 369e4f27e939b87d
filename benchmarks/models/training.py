"""What the blend quality models share: the special tokens, a question, the model's shape and the
training loop (benchmarks/models/blend.py's lookup task and benchmarks/models/multihop.py's bindings
each bring their data, embeddings and vocabulary)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BOS, EOS, PAD = 1, 2, 0
PASSAGE = 3
"""Starts every passage."""
QUERY = 4
"""Starts the question: QUERY key -> value."""
END = 5
"""Closes every passage."""


@dataclasses.dataclass(frozen=True)
class Question:
    prompt: list[int]
    answer: int
    segments: list[tuple[int, int]]
    """(start, end) of each passage in the prompt: the boundaries a RAG client would mark."""


def model_config(vocab_size: int) -> Any:
    """The quality models' shape: an 8-layer Llama, hidden 128, 2 heads, tied embeddings."""
    from transformers import LlamaConfig  # noqa: PLC0415 - keep `--help` fast

    return LlamaConfig(
        hidden_size=128,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        dtype="float32",
        attn_implementation="sdpa",
        initializer_range=0.1,
    )


def train(
    out: Path,
    *,
    steps: int,
    seed: int,
    config: Callable[[], Any],
    init: Callable[[Any], None],
    batches: Callable[[random.Random, int, int], tuple[Any, Any, dict[str, int]]],
    log_every: int = 50,
    readout_layer: int = 4,
    check: Callable[[Any], dict[str, float]] | None = None,
    check_every: int = 0,
) -> dict[str, object]:
    """Train from scratch with a fixed seed and save with save_pretrained (safetensors; the
    weights are stored in float16 to keep the fixture small and load as float32). `config`,
    `init` and `batches` make the model, shape its first embeddings and draw each step's data
    (benchmarks/models/blend.py's lookup task and benchmarks/models/multihop.py's bindings). `check`,
    when given, measures the model every `check_every` steps and at the end (held-out accuracy): its
    results go to the log and to training.json."""
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = LlamaForCausalLM(config())
    # Structured first embeddings and an initialisation wider than the default: both shorten the
    # plateau before the model learns to look things up from many minutes to a couple of hundred steps.
    init(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))) * 0.95 + 0.05

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    started = time.time()
    history = []
    for step in range(steps):
        x, labels, shape = batches(rng, step, steps)
        # Inputs, or inputs and their position ids (benchmarks/models/multihop.py shuffles them).
        x, positions = x if isinstance(x, tuple) else (x, None)
        # Labels of the last layer's output, and optionally of layer `readout_layer`'s (a step that
        # must be done by then, read through the final norm and the output head).
        y, early = labels if isinstance(labels, tuple) else (labels, None)
        # Only the answers are scored: the output head runs on those positions alone.
        outputs = model.model(input_ids=x, position_ids=positions, output_hidden_states=early is not None)
        hidden = outputs.last_hidden_state
        scored = y != -100
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[scored]), y[scored], reduction="sum")
        count = scored.sum()
        if early is not None:
            marked = early != -100
            middle = model.model.norm(outputs.hidden_states[readout_layer])
            loss = loss + torch.nn.functional.cross_entropy(
                model.lm_head(middle[marked]), early[marked], reduction="sum"
            )
            count = count + marked.sum()
        loss = loss / count
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        checked: dict[str, float] = {}
        if check is not None and ((check_every and step % check_every == check_every - 1) or step == steps - 1):
            model.eval()
            checked = check(model)
            model.train()
        if step % log_every == 0 or step == steps - 1 or checked:
            history.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "passages": shape["passages"],
                    "tokens": int(x.shape[1]),
                    "seconds": round(time.time() - started, 1),
                    **checked,
                }
            )
            print(
                f"step {step:5d}  loss {loss.item():.4f}  passages {shape['passages']:2d}  "
                f"tokens {x.shape[1]:5d}  {time.time() - started:6.1f}s"
                + "".join(f"  {name} {value:.3f}" for name, value in checked.items()),
                flush=True,
            )
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    weights = {
        name: tensor.to(torch.float16).contiguous()
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }  # tied to the embeddings
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    info = {
        "seed": seed,
        "steps": steps,
        "torch": torch.__version__,
        "seconds": round(time.time() - started, 1),
        "final_loss": history[-1]["loss"],
        **{f"final_{name}": value for name, value in checked.items()},
    }
    (out / "training.json").write_text(json.dumps({**info, "history": history}, indent=1) + "\n")
    return info
