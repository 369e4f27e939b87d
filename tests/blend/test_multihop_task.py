"""The multi-hop task's data (benchmarks/blend_multihop.py), without a model: each name takes the
value of the last fact before it, which sits in the previous passage, so its answer changes with
the order of the passages."""

from __future__ import annotations

import random

import pytest

from benchmarks import blend_multihop as task


def test_a_corpus_has_names_of_its_own_before_its_facts():
    corpus = task.make_corpus(task.MAX_CORPUS, seed=3)
    assert len({p.name for p in corpus}) == len(corpus)
    for passage in corpus:
        assert len(passage.tokens) == task.PASSAGE_TOKENS
        assert passage.tokens[0] == task.PASSAGE and passage.tokens[-1] == task.END
        name_at = passage.tokens.index(passage.name)
        fact_places = [i for i, t in enumerate(passage.tokens) if t >= task.FACT_BASE]
        assert [t for t in passage.tokens if t >= task.FACT_BASE] == [task.fact(k, v) for k, v in passage.facts]
        assert name_at <= 1 + task.SLACK and name_at < fact_places[0]
        assert fact_places[-1] >= task.PASSAGE_TOKENS - 2 - task.SLACK


def test_a_name_takes_the_previous_passage_s_last_value():
    corpus = task.make_corpus(6, seed=4)
    found = dict(task.bound(corpus))
    assert corpus[0].name not in found  # nothing before the first passage
    for before, passage in zip(corpus[:-1], corpus[1:], strict=True):
        assert found[passage.name] == before.facts[-1][1]


def test_the_answer_depends_on_the_order():
    corpus = task.make_corpus(task.MAX_CORPUS, seed=5)
    differs = 0
    for first in range(len(corpus) - 2):
        a, b, c = corpus[first : first + 3]
        if dict(task.bound([a, c]))[c.name] != dict(task.bound([b, c]))[c.name]:
            differs += 1
    assert differs > (len(corpus) - 2) // 2


def test_a_question_asks_with_its_own_token_and_marks_the_passages():
    rng = random.Random(6)
    corpus = task.make_corpus(task.MAX_CORPUS, seed=6)
    q = task.draw_question(rng, corpus, task.MAX_PASSAGES)
    assert q.prompt[-2] == task.QUERY and q.prompt[-1] in range(task.ASK_BASE, task.VOCAB)
    name = q.prompt[-1] - task.ASK_BASE + task.NAMES.start
    passages = [next(p for p in corpus if p.tokens == tuple(q.prompt[s:e])) for s, e in q.segments]
    assert dict(task.bound(passages))[name] == q.answer
    assert len(q.prompt) == 1 + task.MAX_PASSAGES * task.PASSAGE_TOKENS + 2


def test_training_batches_score_the_names_and_the_answers():
    x, (labels, middle) = task.training_batch(random.Random(7), batch=3, passages=4, queries=16, body=task.MIN_BODY)
    assert x.shape == labels.shape == middle.shape
    for row in range(3):
        names = [i for i, t in enumerate(x[row].tolist()) if t in task.NAMES]
        assert (middle[row] != -100).nonzero().flatten().tolist() == [i for i in names if labels[row, i] != -100]
        assert len(names) - 1 == int((middle[row] != -100).sum())  # every name but the first passage's
        asked = [i + 1 for i, t in enumerate(x[row].tolist()) if t == task.QUERY]
        assert all(labels[row, i] == x[row, i + 1] for i in asked)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"count": 0}, "count: a corpus holds 1 to 32 passages, got 0"),
        ({"count": 33}, "count: a corpus holds 1 to 32 passages, got 33"),
        ({"count": 2, "body": 5}, "body: a passage's name, facts and slack take 11 tokens, got 5"),
    ],
)
def test_bad_corpus_shapes_are_refused_by_name(arguments, message):
    with pytest.raises(ValueError, match=message):
        task.make_corpus(seed=1, **arguments)


def test_a_question_needs_two_passages():
    corpus = task.make_corpus(2, seed=8)
    with pytest.raises(ValueError, match="at least two passages"):
        task.make_question(random.Random(1), corpus[:1])
