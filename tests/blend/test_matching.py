"""Matching: content keys of every window, fragments found at any offset, a non-overlapping choice, segments."""

from __future__ import annotations

import uuid

import pytest

from tests.blend.conftest import BLOCK_TOKENS, blend_engine, tokens
from worker.dataplane.blend.matching import (
    Fragment,
    check_segments,
    choose,
    content_keys_at,
    segment_windows,
)
from worker.dataplane.blend.options import BlendError
from worker.dataplane.hashing import content_key


def test_rolling_keys_are_the_content_keys_of_each_window():
    ids = tokens(50, seed=1)
    model = uuid.uuid4()
    rolled = content_keys_at(ids, range(0, 50), ns_salt=b"salt", model_key=model, block_tokens=8)
    assert sorted(rolled) == list(range(0, 43))  # windows running past the end have no key
    for offset, key in rolled.items():
        assert key == content_key(ns_salt=b"salt", model_key=model, token_ids=ids[offset : offset + 8])


def fragment(start: int, tier: str = "host", size: int = 4) -> Fragment:
    return Fragment(start=start, tokens=size, key=uuid.uuid4(), source_position=0, tier=tier)


def test_choice_covers_the_most_blocks_without_overlap():
    # Greedy left-to-right would take 1 (1..5) and then only 9: the best cover is 2, 6, 10.
    candidates = {1: fragment(1), 2: fragment(2), 6: fragment(6), 9: fragment(9), 10: fragment(10)}
    picked = choose(candidates, start=0, end=14)
    assert [f.start for f in picked] == [2, 6, 10]
    ends = [f.end for f in picked]
    assert all(end <= nxt.start for end, nxt in zip(ends, picked[1:], strict=False))


def test_choice_prefers_faster_tiers_at_equal_cover():
    candidates = {0: fragment(0, "remote"), 1: fragment(1, "device"), 5: fragment(5, "disk")}
    picked = choose(candidates, start=0, end=10)
    assert [(f.start, f.tier) for f in picked] == [(1, "device"), (5, "disk")]


def test_choice_keeps_inside_the_range():
    candidates = {0: fragment(0), 7: fragment(7)}
    assert [f.start for f in choose(candidates, start=0, end=10)] == [0]  # 7..11 would cover the last token


@pytest.mark.parametrize("offset", [3, 17, 30])
def test_engine_finds_fragments_at_arbitrary_offsets(models, offset):
    model = models("tiny")
    engine = blend_engine(model)
    passage = tokens(3 * BLOCK_TOKENS, seed=2)
    first = engine.generate([1, *tokens(9, seed=3), *passage, 5], max_tokens=1)
    assert first.trace.fragment_tokens == 0
    # The blocks of the first prompt sit on its own grid: passage tokens 6..22, 22..38 are whole blocks.
    prompt = [1, *tokens(offset, seed=4), *passage, *tokens(7, seed=5)]
    second = engine.generate(prompt, max_tokens=1)
    assert second.trace.blend == "blend"
    assert second.trace.fragment_tokens == 2 * BLOCK_TOKENS
    assert second.trace.fragment_blocks_by_tier == {"device": 2}


def test_segments_store_blocks_aligned_to_passages(models):
    model = models("tiny")
    engine = blend_engine(model)
    passage = tokens(3 * BLOCK_TOKENS, seed=6)
    start = 11
    prompt = [1, *tokens(start - 1, seed=7), *passage, 9]
    engine.generate(prompt, max_tokens=1, segments=[[start, start + len(passage)]])
    later = [1, *tokens(25, seed=8), *passage, *tokens(4, seed=9)]
    again = engine.generate(later, max_tokens=1)
    assert again.trace.fragment_tokens == len(passage)  # all three blocks of the passage


def test_overlapping_windows_are_never_both_used(models):
    model = models("tiny")
    engine = blend_engine(model)
    run = tokens(40, seed=10)
    # Two stored copies of overlapping windows: 0..16 and 8..24 of `run`.
    engine.generate([1, *tokens(15, seed=11), *run[:BLOCK_TOKENS], 3], max_tokens=1, segments=[[16, 16 + BLOCK_TOKENS]])
    engine.generate(
        [1, *tokens(15, seed=12), *run[8 : 8 + BLOCK_TOKENS], 3], max_tokens=1, segments=[[16, 16 + BLOCK_TOKENS]]
    )
    result = engine.generate([1, *tokens(20, seed=13), *run[:24], *tokens(6, seed=14)], max_tokens=1)
    assert result.trace.fragment_tokens == BLOCK_TOKENS


def test_segment_windows_stay_inside_each_segment():
    assert segment_windows([(3, 40), (40, 50)], block_tokens=16, limit=100) == [3, 19]
    assert segment_windows([(0, 64)], block_tokens=16, limit=40) == [0, 16]


@pytest.mark.parametrize(
    ("segments", "field", "message"),
    [
        ("0-10", "segments", "must be a list"),
        ([[0, 5], [3, 8]], "segments[1]", "inside the previous segment"),
        ([[5, 2]], "segments[0]", "0 <= start < end <= 20"),
        ([[0, 21]], "segments[0]", "0 <= start < end <= 20"),
        ([[0, 5, 9]], "segments[0]", "pair of integers"),
        ([[0, True]], "segments[0]", "pair of integers"),
    ],
)
def test_bad_segments_name_the_entry(segments, field, message):
    with pytest.raises(BlendError, match=message) as caught:
        check_segments(segments, 20)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


def test_engine_refuses_bad_segments_before_touching_anything(models):
    model = models("tiny")
    engine = blend_engine(model)
    with pytest.raises(ValueError, match=r"segments\[0\]: "):
        engine.generate(tokens(20, seed=15), max_tokens=1, segments=[[0, 99]])
    assert not engine.traces and engine.store.tier("device").usage().blocks == 0


def test_known_passages_cost_one_key_per_block_and_the_rest_is_scanned_at_every_offset(models, monkeypatch):
    from worker.dataplane.engine import engine as engine_module  # noqa: PLC0415

    hashed: list[int] = []

    def counted(token_ids, offsets, **kwargs):
        offsets = list(offsets)
        hashed.append(len(offsets))
        return content_keys_at(token_ids, offsets, **kwargs)

    monkeypatch.setattr(engine_module, "content_keys_at", counted)
    model = models("tiny")
    engine = blend_engine(model)
    header = [1, *tokens(15, seed=20)]
    passages = [tokens(2 * BLOCK_TOKENS, seed=seed) for seed in (21, 22, 23)]

    def rag(order: list[int], tail: list[int]) -> tuple[list[int], list[list[int]]]:
        prompt, segments = list(header), []
        for i in order:
            segments.append([len(prompt), len(prompt) + len(passages[i])])
            prompt += passages[i]
        return prompt + tail, segments

    first, marks = rag([0, 1, 2], [5])
    engine.generate(first, max_tokens=1, segments=marks)
    hashed.clear()
    again, marks = rag([2, 0, 1], [7, 8])
    result = engine.generate(again, max_tokens=1, segments=marks, write_back=False)
    assert result.trace.fragment_tokens == 6 * BLOCK_TOKENS
    # The segment windows and the block grid after the header only: every token is covered by them.
    assert hashed == [6]
    # An unknown passage leaves a stretch no likely window covers: it alone is scanned at every offset.
    hashed.clear()
    novel = tokens(2 * BLOCK_TOKENS, seed=24)
    mixed, marks = rag([1], [])
    mixed = [*mixed, *novel, *passages[2], 9]
    last = [len(mixed) - 1 - 2 * BLOCK_TOKENS, len(mixed) - 1]
    result = engine.generate(mixed, max_tokens=1, segments=[*marks, last], write_back=False)
    assert result.trace.fragment_tokens == 4 * BLOCK_TOKENS
    # (the 17 windows inside the novel passage but the 2 on the grid, looked up already)
    assert len(hashed) == 2 and hashed[1] == (2 * BLOCK_TOKENS - BLOCK_TOKENS + 1) - 2
