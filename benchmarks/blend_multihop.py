"""The multi-hop blend quality model: a small Llama trained on a task where one passage's tokens must
attend to another passage for the answer to be reachable.

The lookup task of benchmarks/blend_model.py never needs a passage to see another one, so fused KV
answers it at r = 0. Here a passage holds facts (one token per key and value, as there) and
bindings: one token per (name, key), "name := the value of key". Every key is defined twice in the
corpus, in two passages, with different values; a binding takes the value of the latest definition
before it in the prompt. The question names a binding (QUERY, the binding's token) whose key the
prompt defines twice, once or twice before the binding's passage, and its answer is the value the
binding took: the key's first value when the second definition comes after the binding, its second
when both come before. The question alone cannot tell these apart (it would have to compare
positions); the binding's own token, which under causal attention sees only the definitions before
it, can (and so can the later definition, which sees whether a binding of its key came first). So
the answer travels between passages before it reaches the question: KV of a passage computed
without the others before it, as fragment reuse at r = 0 serves it, holds the wrong value or none.

Training scores the binding's own output (its value, at the last and the middle layer) and the
questions' answers; it starts on passages of facts and bindings alone and then moves to 64-token
passages with filler words, up to TRAIN_PASSAGES per prompt.

    python -m benchmarks.blend_multihop train --out tests/fixtures/blend-multihop   # ~13 min on 2 cores
    python -m benchmarks.blend_model quality --task multihop --save
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import blend_base

BOS, PASSAGE, QUERY, END = blend_base.BOS, blend_base.PASSAGE, blend_base.QUERY, blend_base.END
PAD = blend_base.PAD
VALUES = range(8, 16)
KEYS = range(16, 80)
NAMES = range(80, 144)
WORDS = range(144, 272)
FACT_BASE = 272
"""Fact tokens: one per (key, value), FACT_BASE + key_index * len(VALUES) + value_index."""
ASK_BASE = FACT_BASE + len(KEYS) * len(VALUES)
"""Question tokens: ASK_BASE + name_index asks for that name's value."""
VOCAB = ASK_BASE + len(NAMES)
PASSAGE_TOKENS = 64
PASSAGE_BODY = PASSAGE_TOKENS - 2
FACTS_PER_PASSAGE = 4
SLACK = 3
"""A passage's name is among its first SLACK + 1 words, its last fact among its last SLACK + 1."""
MIN_BODY = FACTS_PER_PASSAGE + 1 + 2 * SLACK
"""The shortest text that holds a name, the facts and the slack (the first training steps' passages)."""
MAX_CORPUS = 32
"""Passages of a corpus: each has a name of its own."""
MAX_PASSAGES = 8
"""Passages per prompt in the quality report (515 tokens)."""
SEED = 20261204


def fact(key: int, value: int) -> int:
    return FACT_BASE + (key - KEYS.start) * len(VALUES) + (value - VALUES.start)


def ask(name: int) -> int:
    """The question's token for `name`: a token of its own, so that what a name does in a passage
    (take the value before it) does not happen in the question."""
    return ASK_BASE + (name - NAMES.start)


@dataclasses.dataclass(frozen=True)
class Passage:
    tokens: tuple[int, ...]
    facts: tuple[tuple[int, int], ...]
    """(key, value) of the passage's facts, in the order of the text."""
    name: int
    """The passage's name token, before its facts: it stands for the value of the last fact before it."""


def make_corpus(
    count: int, *, seed: int | None = None, rng: random.Random | None = None, body: int = PASSAGE_BODY
) -> list[Passage]:
    """`count` passages (at most MAX_CORPUS), each with a name of its own near its start and
    FACTS_PER_PASSAGE facts after it, the last one near its end, among `body` tokens of filler
    words. So a name is a few tokens after the previous passage's last fact, with the passage
    boundary between them."""
    if not 1 <= count <= MAX_CORPUS:
        raise ValueError(f"count: a corpus holds 1 to {MAX_CORPUS} passages, got {count}")
    if body < MIN_BODY:
        raise ValueError(f"body: a passage's name, facts and slack take {MIN_BODY} tokens, got {body}")
    rng = rng or random.Random(seed)
    names = rng.sample(NAMES, count)
    passages = []
    for name in names:
        facts = tuple((k, rng.choice(VALUES)) for k in rng.sample(KEYS, FACTS_PER_PASSAGE))
        text = [rng.choice(WORDS) for _ in range(body)]
        first, last = rng.randint(0, SLACK), body - 1 - rng.randint(0, SLACK)
        places = [*sorted(rng.sample(range(first + 1, last), FACTS_PER_PASSAGE - 1)), last]
        text[first] = name
        for (k, v), place in zip(facts, places, strict=True):
            text[place] = fact(k, v)
        passages.append(Passage((PASSAGE, *text, END), facts, name))
    return passages


def bound(passages: Sequence[Passage]) -> list[tuple[int, int]]:
    """(name, value) of the names, in this order of passages, that have a fact before them: a
    name takes the value of the last fact before it, the previous passage's last fact."""
    return [(p.name, passages[i - 1].facts[-1][1]) for i, p in enumerate(passages) if i > 0]


def answerable(passages: Sequence[Passage]) -> list[tuple[int, int]]:
    """(name, value) of the names that can be asked about (see `bound`)."""
    return bound(passages)


def make_question(
    rng: random.Random, passages: Sequence[Passage], *, header: Sequence[int] = ()
) -> blend_base.Question:
    """BOS, an optional header (filler words), the passages in the given order, then QUERY and the
    question token of a name: "what value did this name take?". At least two passages."""
    pool = answerable(passages)
    if not pool:
        raise ValueError("passages: a question needs at least two passages (the first one's name has no value)")
    prompt = [BOS, *header]
    segments = []
    for passage in passages:
        segments.append((len(prompt), len(prompt) + len(passage.tokens)))
        prompt += passage.tokens
    name, value = rng.choice(pool)
    return blend_base.Question(prompt=[*prompt, QUERY, ask(name)], answer=value, segments=segments)


def draw_question(rng: random.Random, corpus: Sequence[Passage], passages: int) -> blend_base.Question:
    """A question over `passages` of `corpus` in a random order."""
    return make_question(rng, rng.sample(list(corpus), passages))


def training_batch(
    rng: random.Random, *, batch: int, passages: int, queries: int, body: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of a filler header and `passages` of a fresh corpus, then up to `queries` QUERY
    ask(name) value triples about different names (padded at the end to one length); labels sit at the
    names: in the passages, the value the name took, and in the questions, the answer."""
    header = rng.randint(0, 32)
    inputs, labels = [], []
    for _ in range(batch):
        chosen = make_corpus(passages, rng=rng, body=body)
        found = answerable(chosen)
        seq = [BOS, *(rng.choice(WORDS) for _ in range(header))]
        label = [-100] * len(seq)
        took = dict(found)
        for p in chosen:
            seq += p.tokens
            # The name's own output is scored too: its value is what it must pick up from the
            # previous passage, which is where the question will read it (the first hop, taught directly).
            label += [took.get(token, -100) for token in p.tokens]
        # Each name is asked once: a second question could copy the first one's answer.
        for token, value in rng.sample(found, min(queries, len(found))):
            seq += [QUERY, ask(token), value]
            label += [-100, value, -100]
        inputs.append(seq)
        labels.append(label)
    longest = max(len(seq) for seq in inputs)
    x = torch.tensor([seq + [PAD] * (longest - len(seq)) for seq in inputs])
    y = torch.tensor([label + [-100] * (longest - len(label)) for label in labels])
    # The names are scored at the model's middle layer too: their value must be there by then, so
    # that the question's later layers can read it.
    early = y.clone()
    early[:, :] = -100
    for row, seq in enumerate(inputs):
        for place, token in enumerate(seq):
            if token in NAMES:
                early[row, place] = y[row, place]
    return x, (y, early)


def evaluate(model: Any, *, seed: int, passages: int = MAX_PASSAGES, questions: int = 64) -> float:
    """Full-prefill accuracy on `questions` fresh questions over `passages` passages of a held-out
    corpus (a quick check while training; the quality report is the measurement)."""
    rng = random.Random(seed)
    corpus = make_corpus(MAX_CORPUS, rng=rng)
    right = 0
    with torch.no_grad():
        for _ in range(questions):
            q = draw_question(rng, corpus, passages)
            logits = model(input_ids=torch.tensor([q.prompt])).logits[0, -1]
            right += int(logits.argmax()) == q.answer
    return right / questions


NAME_STEPS = 400
"""The first steps score the names alone: a question can learn to read a name's value only once it is there."""
DENSE_STEPS = 800
"""Training starts on passages made of their facts and bindings alone (8 tokens): the two hops are
learnt there; 64-token passages with filler come after, up to TRAIN_PASSAGES of them."""
TRAIN_PASSAGES = 10
"""Past the MAX_PASSAGES the report asks about: a model is weakest at the edge of what it was trained on."""
TOKENS_PER_STEP = 32 * PASSAGE_TOKENS
READOUT_LAYER = 2
"""The names are scored at this layer's output too: their value is there early, and the later
layers have room to read it."""


def batches(rng: random.Random, step: int, steps: int) -> tuple[torch.Tensor, Any, dict[str, int]]:
    """One training step: the curriculum's shape, then its data."""
    if step < DENSE_STEPS:
        queries = 0 if step < NAME_STEPS else 16
        shape = {"passages": rng.randint(3, 6), "body": MIN_BODY, "batch": 32, "queries": queries}
    else:
        ramp = max(1, (steps - DENSE_STEPS) * 5 // 10)
        most = 4 + min(TRAIN_PASSAGES - 4, (step - DENSE_STEPS) * (TRAIN_PASSAGES - 4) // ramp)
        passages = rng.randint(3, most) if rng.random() < 0.5 else rng.randint(max(3, most // 2), most)
        shape = {
            "passages": passages,
            "body": PASSAGE_BODY,
            "batch": max(2, TOKENS_PER_STEP // (passages * PASSAGE_TOKENS)),
            "queries": 16,
        }
    x, y = training_batch(
        rng, batch=shape["batch"], passages=shape["passages"], queries=shape["queries"], body=shape["body"]
    )
    return x, y, shape


def model_config() -> Any:
    """The lookup model's shape (8 layers, hidden 128) with this task's vocabulary and 4 heads of
    32: a question reads a name while other heads find the facts."""
    config = blend_base.model_config(VOCAB)
    config.num_attention_heads = config.num_key_value_heads = 4
    config.head_dim = config.hidden_size // 4
    return config


def init_embeddings(model: Any) -> None:
    """A fact starts as the sum of its key's and value's embeddings (what it means), so its value
    can be read from the first step; a question's token starts as its name's embedding plus the
    question marker's, so that finding the name is there from the first step too."""
    with torch.no_grad():
        table = model.model.embed_tokens.weight
        for k in KEYS:
            for v in VALUES:
                table[fact(k, v)] = table[k] + table[v]
        for n in NAMES:
            table[ask(n)] = table[n] + table[QUERY]


def train(out: Path, *, steps: int, seed: int = SEED, log_every: int = 50, check_every: int = 200) -> dict[str, object]:
    """Train from scratch with a fixed seed and save (`blend_base.train`); every `check_every`
    steps the log shows full-prefill accuracy on held-out questions of 8 passages."""
    return blend_base.train(
        out,
        steps=steps,
        seed=seed,
        log_every=log_every,
        config=model_config,
        init=init_embeddings,
        batches=batches,
        check=lambda model: {"accuracy": evaluate(model, seed=seed + 1)},
        check_every=check_every,
        readout_layer=READOUT_LAYER,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.blend_multihop", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the model and save it")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=1400)
    t.add_argument("--seed", type=int, default=SEED)
    t.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(train(args.out, steps=args.steps, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
