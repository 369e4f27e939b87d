"""The blend quality model: a small Llama trained on key-value retrieval across shuffled passages.

Random weights make attention meaningless, so the quality of fragment reuse (RoPE re-alignment
plus selective recompute) is measured on a model that has learnt to attend across passages. The
task: a prompt holds k passages in random order, each a passage marker, 126 tokens of text (filler
words with 12 facts among them, one token per (key, value) pair) and a closing token; it ends
with a query marker and a key that occurs in exactly one passage; the answer is that key's value
(one token). Answering needs the query to find, among thousands of tokens, the passage holding
its key. Passages are as long as RAG chunks are (128 tokens), and prompts of 16 passages are 2K
tokens long: long enough that prefill, not bookkeeping, is what a CPU spends its time on.

    python -m benchmarks.models.blend train --out tests/fixtures/blend-model   # ~12 min on 2 cores
    python -m benchmarks.models.blend quality --model tests/fixtures/blend-model

Training is reproducible: fixed seed, data drawn from a seeded generator, a fixed thread count;
the same command gives the same weights with the same torch build.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.models import training

if TYPE_CHECKING:
    from worker.dataplane.engine.engine import Engine
    from worker.dataplane.models.loading import LoadedModel

BOS, EOS, PAD = training.BOS, training.EOS, training.PAD
PASSAGE, QUERY, END = training.PASSAGE, training.QUERY, training.END
Question = training.Question
VALUES = range(8, 16)
KEYS = range(16, 528)
WORDS = range(528, 784)
"""Filler text: the words between the facts, and headers and party names around passages."""
FACT_BASE = 784
"""Fact tokens: one per (key, value), FACT_BASE + key_index * len(VALUES) + value_index."""
VOCAB = FACT_BASE + len(KEYS) * len(VALUES)
PASSAGE_TOKENS = 128
"""Marker, 126 tokens of text and a closing token."""
PASSAGE_BODY = PASSAGE_TOKENS - 2
FACTS_PER_PASSAGE = 12
SEED = 20261201


def fact(key: int, value: int) -> int:
    return FACT_BASE + (key - KEYS.start) * len(VALUES) + (value - VALUES.start)


def words(rng: random.Random, count: int) -> list[int]:
    """`count` filler words (a header, party names, dates)."""
    return [rng.choice(WORDS) for _ in range(count)]


@dataclasses.dataclass(frozen=True)
class Passage:
    tokens: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]


def make_passage(rng: random.Random, *, facts: int = FACTS_PER_PASSAGE, body: int = PASSAGE_BODY) -> Passage:
    """A passage of `facts` facts about distinct keys (values drawn at random) at random places
    among `body - facts` filler words."""
    keys = rng.sample(KEYS, facts)
    pairs = tuple((k, rng.choice(VALUES)) for k in keys)
    text = words(rng, body)
    for (k, v), place in zip(pairs, sorted(rng.sample(range(body), facts)), strict=True):
        text[place] = fact(k, v)
    return Passage((PASSAGE, *text, END), pairs)


def make_corpus(count: int, *, seed: int) -> list[Passage]:
    """`count` passages (the documents' chunks of a RAG workload)."""
    rng = random.Random(seed)
    return [make_passage(rng) for _ in range(count)]


def unique_pairs(passages: Sequence[Passage]) -> list[tuple[int, int]]:
    """(key, value) of the keys that occur exactly once across `passages` (unambiguous questions)."""
    counts: dict[int, int] = {}
    for p in passages:
        for k, _ in p.pairs:
            counts[k] = counts.get(k, 0) + 1
    return [(k, v) for p in passages for k, v in p.pairs if counts[k] == 1]


def make_question(rng: random.Random, passages: Sequence[Passage], *, header: Sequence[int] = ()) -> Question:
    """BOS, an optional shared header, the passages in the given order, then QUERY key."""
    prompt = [BOS, *header]
    segments = []
    for passage in passages:
        segments.append((len(prompt), len(prompt) + len(passage.tokens)))
        prompt += passage.tokens
    key, value = rng.choice(unique_pairs(passages))
    prompt += [QUERY, key]
    return Question(prompt=prompt, answer=value, segments=segments)


def training_batch(
    rng: random.Random,
    *,
    batch: int,
    passages: int,
    queries: int,
    facts: int = FACTS_PER_PASSAGE,
    body: int = PASSAGE_BODY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of a filler header (0-64 words) and fresh passages, then `queries` QUERY key
    value triples. Labels sit at the key: the position whose output must be the value."""
    header = rng.randint(0, 64)
    inputs, labels = [], []
    for _ in range(batch):
        chosen = [make_passage(rng, facts=facts, body=body) for _ in range(passages)]
        seq = [BOS, *words(rng, header)]
        for p in chosen:
            seq += p.tokens
        label = [-100] * len(seq)
        pool = unique_pairs(chosen)
        for _ in range(queries):
            k, v = rng.choice(pool)
            seq += [QUERY, k, v]
            label += [-100, v, -100]
        inputs.append(seq)
        labels.append(label)
    return torch.tensor(inputs), torch.tensor(labels)


DENSE_STEPS = 350
"""Training starts on short passages made of facts only (the lookup is learnt there, in a few
hundred steps); sparse 128-token passages with filler come after, up to TRAIN_PASSAGES of them."""
MAX_PASSAGES = 16
"""The longest prompts the quality report and the benchmark ask about (2K tokens)."""
TRAIN_PASSAGES = 20
"""Training goes past MAX_PASSAGES: accuracy falls at the edge of what a model was trained on."""
TOKENS_PER_STEP = 32 * PASSAGE_TOKENS
"""Batch size falls as prompts grow: every step of the sparse phase is about as long."""


def curriculum(rng: random.Random, step: int, steps: int) -> dict[str, int]:
    """The passages per prompt, their shape, the batch size and the questions per sequence of a
    training step."""
    if step < DENSE_STEPS:
        return {"passages": rng.randint(1, 4), "facts": 30, "body": 30, "batch": 16, "queries": 16}
    ramp = max(1, (steps - DENSE_STEPS) * 6 // 10)  # the longest prompts arrive after 60% of the rest
    most = 2 + min(TRAIN_PASSAGES - 2, (step - DENSE_STEPS) * (TRAIN_PASSAGES - 2) // ramp)
    # Half the steps draw from the longer half: long prompts are the hard ones.
    passages = rng.randint(1, most) if rng.random() < 0.5 else rng.randint(max(1, most // 2), most)
    return {
        "passages": passages,
        "facts": FACTS_PER_PASSAGE,
        "body": PASSAGE_BODY,
        "batch": max(2, TOKENS_PER_STEP // (passages * PASSAGE_TOKENS)),
        "queries": 32,
    }


def model_config() -> Any:
    return training.model_config(VOCAB)


def init_embeddings(model: Any) -> None:
    """A fact token starts as the sum of its key's and its value's embeddings (what it means)."""
    with torch.no_grad():
        table = model.model.embed_tokens.weight
        for k in KEYS:
            for v in VALUES:
                table[fact(k, v)] = table[k] + table[v]


def step_batch(rng: random.Random, step: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """The inputs, labels and shape of one training step of the lookup task."""
    shape = curriculum(rng, step, steps)
    x, y = training_batch(
        rng,
        batch=shape["batch"],
        passages=shape["passages"],
        queries=shape["queries"],
        facts=shape["facts"],
        body=shape["body"],
    )
    return x, y, shape


def train(out: Path, *, steps: int, seed: int = SEED, log_every: int = 50) -> dict[str, object]:
    """Train the lookup model from scratch with a fixed seed and save it (`training.train`)."""
    return training.train(
        out,
        steps=steps,
        seed=seed,
        log_every=log_every,
        config=model_config,
        init=init_embeddings,
        batches=step_batch,
    )


def fixture_engine(
    model: LoadedModel,
    *,
    block_tokens: int = 32,
    blocks: int = 4096,
    percent: float = 15.0,
    selection: str = "deviation",
    sample_rate: float = 0.0,
    enabled: bool = True,
    check_layer: int | None = None,
) -> Engine:
    """An engine with fragment reuse over an in-memory block pool (the device tier on CPU); the
    check layer is BlendOptions' unless given."""
    from worker.dataplane.blend.options import BlendOptions  # noqa: PLC0415
    from worker.dataplane.engine.engine import Engine, EngineOptions  # noqa: PLC0415
    from worker.dataplane.layout import BlockLayout  # noqa: PLC0415
    from worker.dataplane.store import TieredStore  # noqa: PLC0415
    from worker.dataplane.tiers.device import DeviceTier  # noqa: PLC0415

    layout = BlockLayout(
        layers=model.layers,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        block_tokens=block_tokens,
        dtype=model.dtype,
    )
    store = TieredStore(layout=layout, tiers=[DeviceTier(layout=layout, capacity_bytes=blocks * layout.block_bytes)])
    options = EngineOptions(
        block_tokens=block_tokens,
        write_back_tier="device",
        keep_in_device=False,
        decide=False,
        blend=BlendOptions(
            enabled=enabled,
            recompute_percent=percent,
            selection=selection,
            sample_rate=sample_rate,
            **({} if check_layer is None else {"check_layer": check_layer}),
        ),
    )
    return Engine(model=model, store=store, options=options)


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    ref = torch.log_softmax(reference.float(), dim=-1)
    oth = torch.log_softmax(other.float(), dim=-1)
    return max(0.0, float(torch.sum(ref.exp() * (ref - oth))))


TASKS = ("lookup", "multihop")
"""The quality tasks: this module's key-value lookup and benchmarks/models/multihop.py's bindings."""
FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
FIXTURE_DIRS = {"lookup": FIXTURES / "blend-model", "multihop": FIXTURES / "blend-multihop"}
PERCENTS = (0, 5, 15, 30, 60)
SELECTION_PREFIX = {"deviation": "blend", "chunk-start": "chunk_start"}
"""Variant names: blend_r15 is deviation selection at r = 15%, chunk_start_r15 EPIC's chunk starts."""


def task_questions(task: str, *, passages: int, seed: int) -> tuple[list[Any], Callable[[random.Random], Question]]:
    """The corpus of `task` whose passages the questions draw on, and a question drawer."""
    if task == "lookup":
        corpus = make_corpus(4 * passages, seed=seed)
        return corpus, lambda rng: make_question(rng, rng.sample(corpus, passages))
    if task == "multihop":
        from benchmarks.models import multihop as multihop_task  # noqa: PLC0415

        multihop = multihop_task.make_corpus(multihop_task.MAX_CORPUS, seed=seed)
        return multihop, lambda rng: multihop_task.draw_question(rng, multihop, passages)
    raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")


def quality_report(
    model_dir: Path,
    *,
    task: str = "lookup",
    questions: int = 100,
    passages: int = MAX_PASSAGES,
    percents: Sequence[float] = PERCENTS,
    selections: Sequence[str] = ("deviation",),
    seed: int = 11,
    block_tokens: int = 32,
    check_layer: int | None = None,
) -> dict[str, dict[str, float]]:
    """Task accuracy and logit KL against full prefill for: full prefill, prefix-only reuse, fused
    KV with nothing recomputed (`fused`: r = 0 and no check layer, the fragments' cached KV at every
    layer), and blend at each r with each selection. The cache is warmed by RAG requests that bring every
    passage once (in groups, so each passage's KV was computed after other passages), then left
    unchanged while every variant answers the same questions. `check_layer` is deviation
    selection's (BlendOptions' unless given)."""
    from worker.dataplane.models.loading import load_model  # noqa: PLC0415

    model = load_model(str(model_dir), device="cpu")
    # Chunk-start selection at r = 0 recomputes no fragment token at any layer: the `fused` variant.
    engines = {
        s: fixture_engine(model, block_tokens=block_tokens, selection=s, check_layer=check_layer)
        for s in dict.fromkeys([*selections, "chunk-start"])
    }
    rng = random.Random(seed)
    corpus, draw = task_questions(task, passages=passages, seed=seed)
    for first in range(0, len(corpus), passages):
        segments, prompt = [], [BOS]
        for passage in corpus[first : first + passages]:
            segments.append((len(prompt), len(prompt) + len(passage.tokens)))
            prompt += passage.tokens
        # The lookup report has always warmed with a question: drawing it keeps the same questions after.
        prompt = make_question(rng, corpus[first : first + passages]).prompt if task == "lookup" else [*prompt, QUERY]
        for engine in engines.values():
            engine.generate(prompt, max_tokens=1, segments=segments)
    variants = [
        "full",
        "prefix_only",
        "fused",
        *[f"{SELECTION_PREFIX[s]}_r{p:g}" for s in selections for p in percents],
    ]
    right = dict.fromkeys(variants, 0)
    kl = dict.fromkeys(variants, 0.0)
    reused = dict.fromkeys(variants, 0)
    recomputed = dict.fromkeys(variants, 0)
    first_engine = engines[selections[0]]
    for _ in range(questions):
        q = draw(rng)
        full = first_engine.generate(q.prompt, max_tokens=1, use_cache=False)
        runs = {
            "full": full,
            "prefix_only": first_engine.generate(q.prompt, max_tokens=1, blend=False, write_back=False),
        }
        fused = engines["chunk-start"]
        assert fused.tuner is not None
        fused.tuner.set_percent("default", 0)
        runs["fused"] = fused.generate(q.prompt, max_tokens=1, segments=q.segments, write_back=False)
        for selection in selections:
            engine = engines[selection]
            for percent in percents:
                if selection == "chunk-start" and percent == 0:
                    runs["chunk_start_r0"] = runs["fused"]  # the same run: nothing recomputed
                    continue
                assert engine.tuner is not None
                engine.tuner.set_percent("default", percent)
                runs[f"{SELECTION_PREFIX[selection]}_r{percent:g}"] = engine.generate(
                    q.prompt, max_tokens=1, segments=q.segments, write_back=False
                )
        for name, run in runs.items():
            right[name] += run.output_ids[0] == q.answer
            kl[name] += kl_divergence(full.first_logits, run.first_logits)
            reused[name] += run.trace.prefix_tokens + run.trace.fragment_tokens
            recomputed[name] += run.trace.recomputed_tokens
    for engine in engines.values():
        engine.close()
        engine.store.close()
    prompt_tokens = len(q.prompt)
    return {
        name: {
            "accuracy": right[name] / questions,
            "kl": kl[name] / questions,
            "reused_tokens": reused[name] / questions,
            "recomputed_tokens": recomputed[name] / questions,
            "prompt_tokens": prompt_tokens,
        }
        for name in variants
    }


def main(argv: Sequence[str] | None = None) -> int:
    from worker.dataplane.blend.options import BlendError, BlendOptions  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m benchmarks.models.blend", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the model and save it")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=1600)
    t.add_argument("--seed", type=int, default=SEED)
    t.add_argument("--threads", type=int, default=2)
    e = sub.add_parser(
        "quality", help="accuracy and KL vs full prefill: full, prefix-only, blend at each r and selection"
    )
    e.add_argument("--task", choices=(*TASKS, "both"), default="both")
    e.add_argument("--model", type=Path, help="the model directory (default: the task's fixture)")
    e.add_argument("--passages", type=int, help="passages per question (default: 16 lookup, 8 multihop)")
    e.add_argument("--questions", type=int, default=100)
    e.add_argument("--percents", default=",".join(f"{p:g}" for p in PERCENTS), help="recompute ratios r, in percent")
    e.add_argument("--selections", default="deviation,chunk-start")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument(
        "--check-layer",
        type=int,
        default=BlendOptions().check_layer,  # recorded in quality.json's arguments
        help="the layer whose KV deviation picks the tokens to recompute (default: the engine's)",
    )
    e.add_argument(
        "--save",
        action="store_true",
        help="write the report to <model>/quality.json (what tests/blend/test_quality*.py check)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.command == "train":
        info = train(args.out, steps=args.steps, seed=args.seed)
        print(json.dumps(info))
        return 0
    tasks = TASKS if args.task == "both" else (args.task,)
    if args.model is not None and len(tasks) > 1:
        parser.error("--model: name one --task with it")
    percents = [float(p) for p in args.percents.split(",") if p.strip()]
    selections = [s.strip() for s in args.selections.split(",") if s.strip()]
    for name in selections:
        if name not in SELECTION_PREFIX:
            parser.error(f"--selections: {name!r} is not one of {', '.join(SELECTION_PREFIX)}")
    try:
        BlendOptions(check_layer=args.check_layer)
    except BlendError as exc:
        parser.error(f"--check-layer: {exc}")
    for name in tasks:
        from benchmarks.models import multihop as multihop_task  # noqa: PLC0415

        model = args.model or FIXTURE_DIRS[name]
        passages = args.passages or (MAX_PASSAGES if name == "lookup" else multihop_task.MAX_PASSAGES)
        arguments = {
            "task": name,
            "questions": args.questions,
            "passages": passages,
            "percents": percents,
            "selections": selections,
            "check_layer": args.check_layer,
        }
        report = quality_report(model, **arguments)  # type: ignore[arg-type]
        print(f"\n{name} ({model}, {passages} passages, {args.questions} questions)")
        print(f"{'variant':<18}{'accuracy':>10}{'KL vs full':>12}{'reused tok':>12}{'recomputed':>12}")
        for variant, row in report.items():
            print(
                f"{variant:<18}{100 * row['accuracy']:>9.1f}%{row['kl']:>12.2e}{row['reused_tokens']:>12.1f}"
                f"{row['recomputed_tokens']:>12.1f}"
            )
        print(json.dumps(report))
        if args.save:
            command = (
                f"python -m benchmarks.models.blend quality --task {name} --passages {passages} "
                f"--questions {args.questions} --percents {args.percents} --selections {args.selections}"
                f" --check-layer {args.check_layer}"
            )
            document = {"command": command, "arguments": arguments, "report": report}
            (model / "quality.json").write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
