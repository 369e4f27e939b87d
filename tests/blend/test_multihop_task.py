"""The multi-hop task's data (benchmarks/models/multihop.py), without a model: every key is defined
twice, a binding takes the definition before it, a question's answer changes with the order of
the passages, and training hides that order from the positions."""

from __future__ import annotations

import random

import pytest

from benchmarks.models import multihop as task


def test_every_key_is_defined_twice_and_bindings_point_elsewhere():
    corpus = task.make_corpus(task.MAX_CORPUS, seed=3)
    defined: dict[int, list[int]] = {}
    for passage in corpus:
        assert len(passage.tokens) == task.PASSAGE_TOKENS
        assert passage.tokens[0] == task.PASSAGE and passage.tokens[-1] == task.END
        for key, value in passage.facts:
            defined.setdefault(key, []).append(value)
            assert task.fact(key, value) in passage.tokens
        own = {key for key, _ in passage.facts}
        for name, key in passage.bindings:
            assert key not in own and task.bind(name, key) in passage.tokens
    assert all(len(values) == 2 and values[0] != values[1] for values in defined.values())
    pairs = [pair for passage in corpus for pair in passage.bindings]
    assert len(pairs) == len(set(pairs))


def test_a_binding_takes_the_definition_before_it():
    corpus = task.make_corpus(task.MAX_CORPUS, seed=4)
    rng = random.Random(4)
    checked = 0
    while checked < 20:
        chosen = rng.sample(corpus, task.MAX_PASSAGES)
        for name, key, value in task.bound(chosen):
            index = next(i for i, p in enumerate(chosen) if (name, key) in p.bindings)
            before = [v for p in chosen[:index] for k, v in p.facts if k == key]
            after = [v for p in chosen[index + 1 :] for k, v in p.facts if k == key]
            assert before == [value] and len(after) == 1 and after[0] != value
            # The other order of the two definitions gives the other value.
            first = next(i for i, p in enumerate(chosen) if key in dict(p.facts))
            last = max(i for i, p in enumerate(chosen) if key in dict(p.facts))
            swapped = list(chosen)
            swapped[first], swapped[last] = swapped[last], swapped[first]
            assert (name, key, after[0]) in task.bound(swapped)
            checked += 1


def test_a_question_asks_with_the_binding_s_token():
    rng = random.Random(6)
    corpus = task.make_corpus(task.MAX_CORPUS, seed=6)
    q = task.draw_question(rng, corpus, task.MAX_PASSAGES)
    assert q.prompt[-2] == task.QUERY and q.prompt[-1] in task.BINDINGS
    passages = [next(p for p in corpus if p.tokens == tuple(q.prompt[s:e])) for s, e in q.segments]
    assert (q.prompt[-1], q.answer) in task.answerable(passages)
    assert len(q.prompt) == 1 + task.MAX_PASSAGES * task.PASSAGE_TOKENS + 2


def test_training_hides_the_order_of_the_passages_from_the_positions():
    (x, positions), (labels, middle) = task.training_batch(
        random.Random(7), batch=4, passages=5, queries=16, body=task.ITEM_TOKENS
    )
    assert x.shape == positions.shape == labels.shape == middle.shape
    length = task.ITEM_TOKENS + 2
    shuffled = 0
    for row in range(4):
        tokens, place = x[row].tolist(), positions[row].tolist()
        assert sorted(place) == list(range(len(place)))  # every position once
        starts = [i for i, t in enumerate(tokens) if t == task.PASSAGE]
        for start in starts:  # a passage keeps its own positions in one piece
            assert place[start : start + length] == list(range(place[start], place[start] + length))
        shuffled += [place[s] for s in starts] != sorted(place[s] for s in starts)
        asked = [i + 1 for i, t in enumerate(tokens) if t == task.QUERY]
        assert asked and all(labels[row, i] == x[row, i + 1] for i in asked)
        assert all(middle[row, i] == -100 for i in asked)
        bindings = [i for i, t in enumerate(tokens) if t in task.BINDINGS and i not in asked]
        assert (middle[row] != -100).nonzero().flatten().tolist() == [i for i in bindings if labels[row, i] != -100]
    assert shuffled >= 2


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"count": 0}, "count: a corpus holds 1 to 32 passages, got 0"),
        ({"count": 33}, "count: a corpus holds 1 to 32 passages, got 33"),
        ({"count": 2, "body": 5}, "body: a passage's facts and bindings take 6 tokens, got 5"),
    ],
)
def test_bad_corpus_shapes_are_refused_by_name(arguments, message):
    with pytest.raises(ValueError, match=message):
        task.make_corpus(seed=1, **arguments)


def test_a_question_needs_an_answerable_binding():
    corpus = task.make_corpus(2, seed=8)
    with pytest.raises(ValueError, match="no binding of these passages"):
        task.make_question(random.Random(1), corpus[:1])
