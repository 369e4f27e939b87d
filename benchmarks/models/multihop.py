"""The multi-hop blend quality model: a small Llama trained on a task where one passage's tokens must
attend to another passage for the answer to be reachable.

The lookup task of benchmarks/models/blend.py never needs a passage to see another one, so fused KV
answers it at r = 0. Here a passage holds facts (one token per key and value, as there) and
bindings: one token per (name, key), "name := the value of key". Every key is defined twice in the
corpus, in two passages, with different values; a binding takes the value of the definition before
it. The question names a binding (QUERY, the binding's token) whose key is defined once before the
binding's passage and once after it, and its answer is the value the binding took.

Which definition came before the binding is a matter of order, and a question that sees the whole
prompt could read the order off the positions (take the key's first definition), an answer that
fused KV keeps, since fragment reuse re-aligns positions. So training scrambles the position ids
of the passages (each keeps its own positions in one piece, at a random place): order is then known
only through what each token saw under the causal mask, and the question has to read the value
from the binding's hidden state, which saw the earlier definition alone. KV of the binding's
passage computed without that definition before it, as fragment reuse at r = 0 serves it, holds
the wrong value or none.

    python -m benchmarks.models.multihop train --out tests/fixtures/blend-multihop   # ~30 min on 2 cores
    python -m benchmarks.models.blend quality --task multihop --save
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

from benchmarks.models import training

BOS, PASSAGE, QUERY, END = training.BOS, training.PASSAGE, training.QUERY, training.END
PAD = training.PAD
VALUES = range(8, 16)
KEYS = range(16, 80)
NAMES = range(80, 96)
WORDS = range(96, 224)
FACT_BASE = 224
"""Fact tokens: one per (key, value), FACT_BASE + key_index * len(VALUES) + value_index."""
BIND_BASE = FACT_BASE + len(KEYS) * len(VALUES)
"""Binding tokens: one per (name, key), "name := the value of key"."""
VOCAB = BIND_BASE + len(NAMES) * len(KEYS)
BINDINGS = range(BIND_BASE, VOCAB)
PASSAGE_TOKENS = 32
PASSAGE_BODY = PASSAGE_TOKENS - 2
FACTS_PER_PASSAGE = 4
BINDINGS_PER_PASSAGE = 2
ITEM_TOKENS = FACTS_PER_PASSAGE + BINDINGS_PER_PASSAGE
MAX_CORPUS = len(KEYS) * 2 // FACTS_PER_PASSAGE
"""Every key is defined twice: a corpus holds at most 32 passages."""
MAX_PASSAGES = 8
"""Passages per prompt in the quality report (259 tokens)."""
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
    """(name, key) of the passage's bindings: a corpus has each pair once."""


def make_corpus(
    count: int, *, seed: int | None = None, rng: random.Random | None = None, body: int = PASSAGE_BODY
) -> list[Passage]:
    """`count` passages (at most MAX_CORPUS); every key of the corpus is defined in two of them with
    different values, and every binding names a key that its own passage does not define."""
    if not 1 <= count <= MAX_CORPUS:
        raise ValueError(f"count: a corpus holds 1 to {MAX_CORPUS} passages, got {count}")
    if body < ITEM_TOKENS:
        raise ValueError(f"body: a passage's facts and bindings take {ITEM_TOKENS} tokens, got {body}")
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
    used: set[tuple[int, int]] = set()
    passages = []
    for group in groups:
        facts = tuple((k, values[k].pop()) for k in dict.fromkeys(group))
        own = {k for k, _ in facts}
        others = [k for k in keys if k not in own] or keys
        bindings: list[tuple[int, int]] = []
        while len(bindings) < BINDINGS_PER_PASSAGE:
            pair = (rng.choice(NAMES), rng.choice(others))
            if pair not in used:
                used.add(pair)
                bindings.append(pair)
        units = [[fact(k, v)] for k, v in facts] + [[bind(n, k)] for n, k in bindings]
        rng.shuffle(units)
        # The filler words fall in the gaps between the units (a binding's two tokens stay together).
        fillers = body - sum(len(u) for u in units)
        cuts = sorted(rng.choices(range(fillers + 1), k=len(units)))
        text, placed = [], 0
        for unit, cut in zip(units, cuts, strict=True):
            text += [rng.choice(WORDS) for _ in range(cut - placed)] + unit
            placed = cut
        text += [rng.choice(WORDS) for _ in range(fillers - placed)]
        passages.append(Passage((PASSAGE, *text, END), facts, tuple(bindings)))
    return passages


def bound(passages: Sequence[Passage]) -> list[tuple[int, int, int]]:
    """(name, key, value) of the bindings, in this order of passages, whose key is defined once
    before the binding's passage and once after it: the value the binding took is the earlier
    one, and the prompt holds the other too, so a question cannot be answered from the facts
    without knowing which of them came before the binding."""
    found = []
    for i, passage in enumerate(passages):
        for name, key in passage.bindings:
            earlier = [v for p in passages[:i] for k, v in p.facts if k == key]
            later = [v for p in passages[i + 1 :] for k, v in p.facts if k == key]
            if len(earlier) == 1 and len(later) == 1:
                found.append((name, key, earlier[0]))
    return found


def answerable(passages: Sequence[Passage]) -> list[tuple[int, int]]:
    """(binding token, value) of the bindings that can be asked about (see `bound`)."""
    return [(bind(name, key), value) for name, key, value in bound(passages)]


def make_question(rng: random.Random, passages: Sequence[Passage], *, header: Sequence[int] = ()) -> training.Question:
    """BOS, an optional header, the passages in the given order, then QUERY and a binding's token:
    "what did this binding take?". The passages must hold an answerable binding (see `answerable`)."""
    pool = answerable(passages)
    if not pool:
        raise ValueError("passages: no binding of these passages has its key defined once before it and once after")
    prompt = [BOS, *header]
    segments = []
    for passage in passages:
        segments.append((len(prompt), len(prompt) + len(passage.tokens)))
        prompt += passage.tokens
    token, value = rng.choice(pool)
    return training.Question(prompt=[*prompt, QUERY, token], answer=value, segments=segments)


def draw_question(rng: random.Random, corpus: Sequence[Passage], passages: int) -> training.Question:
    """A question over `passages` of `corpus` in a random order that has an answerable binding."""
    while True:
        chosen = rng.sample(list(corpus), passages)
        if answerable(chosen):
            return make_question(rng, chosen)


def training_batch(
    rng: random.Random, *, batch: int, passages: int, queries: int, body: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of a filler header and `passages` of a fresh corpus in random order, then up to
    `queries` QUERY binding value triples about different bindings (padded at the end to one
    length), with their position ids; labels sit at the bindings: in the passages, the value the
    binding took, and in the questions, the answer.

    The position ids give each passage its own positions in one piece but at a shuffled place
    (the header before them, the questions after): the order of the passages is not in the
    positions, only in the causal mask (see the module's docstring)."""
    header = rng.randint(0, 32)
    inputs, labels, positions = [], [], []
    for _ in range(batch):
        # Both definitions of every key are in the prompt: going from the question to the key's
        # facts finds two values, and only what the passages saw in this order tells which one the
        # binding took.
        while not (found := answerable(chosen := make_corpus(passages, rng=rng, body=body))):
            pass
        seq = [BOS, *(rng.choice(WORDS) for _ in range(header))]
        label = [-100] * len(seq)
        took = dict(found)
        for p in chosen:
            seq += p.tokens
            # The binding's own output is scored too: its value is what it must pick up from the
            # earlier passage, which is where the question will read it (the first hop, taught directly).
            label += [took.get(token, -100) for token in p.tokens]
        # Each binding is asked once: a second question could copy the first one's answer.
        for token, value in rng.sample(found, min(queries, len(found))):
            seq += [QUERY, token, value]
            label += [-100, value, -100]
        inputs.append(seq)
        labels.append(label)
        length = body + 2
        slots = rng.sample(range(passages), passages)
        place = [*range(1 + header)]
        for slot in slots:
            place += range(1 + header + slot * length, 1 + header + (slot + 1) * length)
        positions.append(place)
    longest = max(len(seq) for seq in inputs)
    ids = torch.arange(longest).repeat(len(inputs), 1)
    for row, place in enumerate(positions):
        ids[row, : len(place)] = torch.tensor(place)
    x = torch.tensor([seq + [PAD] * (longest - len(seq)) for seq in inputs])
    y = torch.tensor([label + [-100] * (longest - len(label)) for label in labels])
    # The bindings are scored at the model's middle layer too: their value must be there by then,
    # so that the question's later layers can read it.
    early = y.clone()
    early[:, :] = -100
    for row, seq in enumerate(inputs):
        for place, token in enumerate(seq):
            if token in BINDINGS and (place == 0 or seq[place - 1] != QUERY):
                early[row, place] = y[row, place]
    return (x, ids), (y, early)


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


DENSE_STEPS = 2000
"""Training starts on passages made of their facts and bindings alone (8 tokens), 3 to TRAIN_PASSAGES
of them: the two hops are learnt there; 32-token passages with filler come after, up to
TRAIN_PASSAGES of them."""
TRAIN_PASSAGES = 10
"""Past the MAX_PASSAGES the report asks about: a model is weakest at the edge of what it was trained on."""
TOKENS_PER_STEP = 2048


def batches(rng: random.Random, step: int, steps: int) -> tuple[Any, Any, dict[str, int]]:
    """One training step: the curriculum's shape, then its data."""
    if step < DENSE_STEPS:
        shape = {"passages": rng.randint(3, TRAIN_PASSAGES), "body": ITEM_TOKENS, "batch": 32, "queries": 16}
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
    32 (a question reads a binding while other heads find the facts)."""
    config = training.model_config(VOCAB)
    config.num_attention_heads = config.num_key_value_heads = 4
    config.head_dim = config.hidden_size // 4
    return config


def init_embeddings(model: Any) -> None:
    """A fact starts as the sum of its key's and value's embeddings, a binding as the sum of its
    name's and key's (what they mean), so matching a binding's key to a fact is there from the
    first step."""
    with torch.no_grad():
        table = model.model.embed_tokens.weight
        for k in KEYS:
            for v in VALUES:
                table[fact(k, v)] = table[k] + table[v]
            for n in NAMES:
                table[bind(n, k)] = table[n] + table[k]


def train(out: Path, *, steps: int, seed: int = SEED, log_every: int = 50, check_every: int = 200) -> dict[str, object]:
    """Train from scratch with a fixed seed and save (`training.train`); every `check_every`
    steps the log shows full-prefill accuracy on held-out questions of 8 passages."""
    return training.train(
        out,
        steps=steps,
        seed=seed,
        log_every=log_every,
        config=model_config,
        init=init_embeddings,
        batches=batches,
        check=lambda model: {"accuracy": evaluate(model, seed=seed + 1)},
        check_every=check_every,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models.multihop", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the model and save it")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=4500)
    t.add_argument("--seed", type=int, default=SEED)
    t.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(train(args.out, steps=args.steps, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
