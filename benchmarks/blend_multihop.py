"""The multi-hop blend quality model: a small Llama trained on a task where one passage's tokens must
attend to another passage for the answer to be reachable.

The lookup task of benchmarks/blend_model.py never needs a passage to see another one, so fused KV
answers it at r = 0. Here a passage holds facts (one token per key and value, as there) and
bindings: one token per (name, key), "name := the value of key". Every key is defined twice in the
corpus, in two passages, with different values; a binding takes the value of the definition that
precedes it in the prompt. The question asks through the name (QUERY name) and its answer is the
value the binding took: the one definition of its key before the binding's passage, while the
other definition may come after it. The query alone cannot tell the two apart (it would have to
compare positions); the binding's own token, which under causal attention sees only the earlier
definition, can. So the answer travels from passage A (the fact) into passage B (the binding's
hidden state) and from there to the query: KV of B computed without A before it, as fragment
reuse at r = 0 serves it, holds the wrong value or none.

    python -m benchmarks.blend_multihop train --out tests/fixtures/blend-multihop   # ~10 min on 2 cores
    python -m benchmarks.blend_model quality --model tests/fixtures/blend-multihop --task multihop
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
VALUES = range(8, 16)
KEYS = range(16, 80)
NAMES = range(80, 144)
WORDS = range(144, 272)
FACT_BASE = 272
"""Fact tokens: one per (key, value), FACT_BASE + key_index * len(VALUES) + value_index."""
BIND_BASE = FACT_BASE + len(KEYS) * len(VALUES)
"""Binding tokens: one per (name, key), BIND_BASE + name_index * len(KEYS) + key_index."""
VOCAB = BIND_BASE + len(NAMES) * len(KEYS)
BINDINGS = range(BIND_BASE, VOCAB)
PASSAGE_TOKENS = 64
PASSAGE_BODY = PASSAGE_TOKENS - 2
FACTS_PER_PASSAGE = 4
BINDINGS_PER_PASSAGE = 2
MAX_CORPUS = len(KEYS) * 2 // FACTS_PER_PASSAGE
"""Every key is defined twice: a corpus holds at most 32 passages."""
MAX_PASSAGES = 8
"""Passages per prompt in the quality report (515 tokens)."""
SEED = 20261204


def fact(key: int, value: int) -> int:
    return FACT_BASE + (key - KEYS.start) * len(VALUES) + (value - VALUES.start)


def bind(name: int, key: int) -> int:
    return BIND_BASE + (name - NAMES.start) * len(KEYS) + (key - KEYS.start)


@dataclasses.dataclass(frozen=True)
class Passage:
    tokens: tuple[int, ...]
    facts: tuple[tuple[int, int], ...]
    """(key, value) of the passage's definitions."""
    bindings: tuple[tuple[int, int], ...]
    """(name, key) of the passage's bindings."""


def make_corpus(
    count: int, *, seed: int | None = None, rng: random.Random | None = None, body: int = PASSAGE_BODY
) -> list[Passage]:
    """`count` passages (at most MAX_CORPUS); every key of the corpus is defined in two of them with
    different values, and every binding names a key that its own passage does not define."""
    if not 1 <= count <= MAX_CORPUS:
        raise ValueError(f"count: a corpus holds 1 to {MAX_CORPUS} passages, got {count}")
    rng = rng or random.Random(seed)
    keys = rng.sample(KEYS, count * FACTS_PER_PASSAGE // 2)
    # Each key twice, in two different passages: deal the keys out in a shuffled double deck.
    slots = [k for k in keys for _ in range(2)]
    while True:
        rng.shuffle(slots)
        groups = [slots[i * FACTS_PER_PASSAGE : (i + 1) * FACTS_PER_PASSAGE] for i in range(count)]
        if all(len(set(g)) == len(g) for g in groups) or count == 1:
            break
    values: dict[int, list[int]] = {k: rng.sample(VALUES, 2) for k in keys}
    names = rng.sample(NAMES, count * BINDINGS_PER_PASSAGE)
    passages = []
    for i, group in enumerate(groups):
        facts = tuple((k, values[k].pop()) for k in dict.fromkeys(group))
        own = {k for k, _ in facts}
        others = [k for k in keys if k not in own] or keys
        bindings = tuple(
            (n, rng.choice(others)) for n in names[i * BINDINGS_PER_PASSAGE : (i + 1) * BINDINGS_PER_PASSAGE]
        )
        items = [fact(k, v) for k, v in facts] + [bind(n, k) for n, k in bindings]
        rng.shuffle(items)
        text = [rng.choice(WORDS) for _ in range(body)]
        for token, place in zip(items, sorted(rng.sample(range(body), len(items))), strict=True):
            text[place] = token
        passages.append(Passage((PASSAGE, *text, END), facts, bindings))
    return passages


def bound(passages: Sequence[Passage]) -> list[tuple[int, int, int]]:
    """(name, key, value) of the bindings, in this order of passages, whose key is defined in exactly
    one earlier passage: the value the binding took."""
    found = []
    for i, passage in enumerate(passages):
        for name, key in passage.bindings:
            earlier = [v for p in passages[:i] for k, v in p.facts if k == key]
            if len(earlier) == 1:
                found.append((name, key, earlier[0]))
    return found


def answerable(passages: Sequence[Passage]) -> list[tuple[int, int]]:
    """(name, value) of the bindings that can be asked about (see `bound`)."""
    return [(name, value) for name, _, value in bound(passages)]


def make_question(
    rng: random.Random, passages: Sequence[Passage], *, header: Sequence[int] = ()
) -> blend_base.Question:
    """BOS, an optional header, the passages in the given order, then QUERY name. The passages must
    hold an answerable binding (see `answerable`)."""
    pool = answerable(passages)
    if not pool:
        raise ValueError("passages: no binding of these passages has exactly one earlier definition of its key")
    prompt = [BOS, *header]
    segments = []
    for passage in passages:
        segments.append((len(prompt), len(prompt) + len(passage.tokens)))
        prompt += passage.tokens
    name, value = rng.choice(pool)
    return blend_base.Question(prompt=[*prompt, QUERY, name], answer=value, segments=segments)


def draw_question(rng: random.Random, corpus: Sequence[Passage], passages: int) -> blend_base.Question:
    """A question over `passages` of `corpus` in a random order that has an answerable binding."""
    while True:
        chosen = rng.sample(list(corpus), passages)
        if answerable(chosen):
            return make_question(rng, chosen)


def training_batch(
    rng: random.Random, *, batch: int, passages: int, queries: int, body: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of a filler header and `passages` of a fresh corpus in random order, then `queries`
    QUERY name value triples; labels sit at the name."""
    header = rng.randint(0, 32)
    inputs, labels = [], []
    for _ in range(batch):
        # Both definitions of every key are in the prompt: going from the query to the key's facts
        # finds two values, and only the binding knows which came first.
        while not (pool := answerable(chosen := make_corpus(passages, rng=rng, body=body))):
            pass
        seq = [BOS, *(rng.choice(WORDS) for _ in range(header))]
        label = [-100] * len(seq)
        took = {bind(name, key): value for name, key, value in bound(chosen)}
        for p in chosen:
            seq += p.tokens
            # The binding's own output is scored too: its value is what it must pick up from the
            # earlier passage, which is where the query will read it (the first hop, taught directly).
            label += [took.get(token, -100) for token in p.tokens]
        for _ in range(queries):
            name, value = rng.choice(pool)
            seq += [QUERY, name, value]
            label += [-100, value, -100]
        inputs.append(seq)
        labels.append(label)
    tensor = torch.tensor(labels)
    # The bindings are scored at the model's middle layer too: their value must be there by then,
    # so that the query's later layers can read it.
    early = torch.where(torch.isin(torch.tensor(inputs), torch.tensor(list(BINDINGS))), tensor, -100)
    return torch.tensor(inputs), (tensor, early)


BINDING_STEPS = 250
"""The first steps score the bindings alone (see `batches`)."""
DENSE_STEPS = 800
"""Training starts on passages made of their facts and bindings alone (8 tokens): the two hops are
learnt there; 64-token passages with filler come after, up to TRAIN_PASSAGES of them."""
TRAIN_PASSAGES = 10
"""Past the MAX_PASSAGES the report asks about: a model is weakest at the edge of what it was trained on."""
TOKENS_PER_STEP = 32 * PASSAGE_TOKENS


def batches(rng: random.Random, step: int, steps: int) -> tuple[torch.Tensor, Any, dict[str, int]]:
    """One training step: the curriculum's shape, then its data."""
    if step < DENSE_STEPS:
        # Bindings alone are scored first: a query learns to go through the name to the key's
        # facts before the binding holds its value, and half its answers are right that way (the
        # later definition is the wrong half), a plateau it does not leave. Once bindings hold
        # their value, reading it through the name is the shorter way, and the one that is always right.
        shape = {
            "passages": rng.randint(3, 6),
            "body": FACTS_PER_PASSAGE + BINDINGS_PER_PASSAGE,
            "batch": 32,
            "queries": 0 if step < BINDING_STEPS else 16,
        }
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
    """The lookup model's shape (8 layers, hidden 128) with this task's vocabulary."""
    return blend_base.model_config(VOCAB)


def init_embeddings(model: Any) -> None:
    """A fact starts as the sum of its key's and value's embeddings, a binding as the sum of its
    name's and key's: what they mean, so matching a key is there from the first step."""
    with torch.no_grad():
        table = model.model.embed_tokens.weight
        for k in KEYS:
            for v in VALUES:
                table[fact(k, v)] = table[k] + table[v]
            for n in NAMES:
                table[bind(n, k)] = table[n] + table[k]


def train(out: Path, *, steps: int, seed: int = SEED, log_every: int = 50) -> dict[str, object]:
    return blend_base.train(
        out, steps=steps, seed=seed, log_every=log_every, config=model_config, init=init_embeddings, batches=batches
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
