"""The differential protocol: the same requests served by vLLM alone and by vLLM with Strata, compared
token by token and by their top-k logprobs at every position, within a tolerance measured from vLLM
alone against itself; and every request's cached tokens held to what vLLM alone would have shared
(its prefix cache shares a page only between requests of the same model, adapter and salt).

A round is a list of `Ask`s sent in one `LLM.generate` call, so they are scheduled together:
hits share steps with cold prefills and with one another. `run_round` returns `Answer`s in order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

PAGE = 32
"""vLLM's page (block_size) in these engines: a page is what its prefix cache shares."""
TOP_K = 5
TOLERANCE_FLOOR = 1e-4
"""The least tolerance on a logprob: a wrong block moves logprobs by 1e-2 or more (measured in the
mutant runs), vLLM against itself by 1e-6 on this float32 checkpoint."""


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request: its prompt, and what else decides its KV (model, adapter, salt)."""

    prompt: tuple[int, ...]
    label: str
    model: str = "x"
    adapter: str = ""
    """The LoRA adapter's name ("" for the base model); `lora_paths` gives its directory."""
    salt: str = ""
    max_tokens: int = 4
    params: tuple[tuple[str, Any], ...] = ()
    """kv_transfer_params entries (a namespace claim, a test fault)."""

    @property
    def scope(self) -> tuple[str, str, str]:
        return (self.model, self.adapter, self.salt)


@dataclasses.dataclass(frozen=True)
class Answer:
    tokens: list[int]
    logprobs: list[dict[int, float]]
    cached: int


def run_round(llm: Any, asks: Sequence[Ask], lora_paths: dict[str, str]) -> list[Answer]:
    """Serve `asks` (greedy, top-k logprobs) and return their answers in order: the base model's in
    one generate call, then the adapters' in another. vLLM 0.32's CPU backend computes a base-model
    request batched with LoRA requests wrongly (its logprobs move by ~5 against the same request
    alone; LoRA requests of both adapters batch together correctly), so the two never share a step
    here, on either side of the comparison."""
    answers: dict[int, Answer] = {}
    for group in ([i for i, a in enumerate(asks) if not a.adapter], [i for i, a in enumerate(asks) if a.adapter]):
        if group:
            answers.update(zip(group, _generate(llm, [asks[i] for i in group], lora_paths), strict=True))
    return [answers[i] for i in range(len(asks))]


def _generate(llm: Any, asks: Sequence[Ask], lora_paths: dict[str, str]) -> list[Answer]:
    from vllm.lora.request import LoRARequest

    adapters = {
        name: LoRARequest(name, index + 1, path) for index, (name, path) in enumerate(sorted(lora_paths.items()))
    }
    prompts, params, loras = [], [], []
    for ask in asks:
        prompt: dict[str, Any] = {"prompt_token_ids": list(ask.prompt)}
        if ask.salt:
            prompt["cache_salt"] = ask.salt
        prompts.append(prompt)
        params.append(sampling(ask))
        loras.append(adapters[ask.adapter] if ask.adapter else None)
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return [answer_of(output) for output in outputs]


def sampling(ask: Ask) -> Any:
    """The sampling parameters of every request of the protocol: greedy, top-k logprobs."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": dict(ask.params)} if ask.params else None
    return SamplingParams(
        max_tokens=ask.max_tokens, temperature=0, ignore_eos=True, logprobs=TOP_K, detokenize=False, extra_args=extra
    )


def answer_of(output: Any) -> Answer:
    """A finished vLLM RequestOutput as an Answer."""
    completion = output.outputs[0]
    return Answer(
        tokens=list(completion.token_ids),
        logprobs=[{token: float(lp.logprob) for token, lp in step.items()} for step in completion.logprobs],
        cached=int(output.num_cached_tokens or 0),
    )


def deviation(reference: Answer, other: Answer) -> float:
    """The largest difference of a logprob both answers report, at the positions where both
    answered the same tokens so far (after a token differs, the contexts differ)."""
    worst = 0.0
    for position, (want, got) in enumerate(zip(reference.logprobs, other.logprobs, strict=False)):
        for token in set(want) & set(got):
            worst = max(worst, abs(want[token] - got[token]))
        if (
            position < min(len(reference.tokens), len(other.tokens))
            and reference.tokens[position] != other.tokens[position]
        ):
            break
    return worst


def tolerance(noise: float) -> float:
    """The tolerance for a run whose vLLM-against-itself deviation was `noise`."""
    return max(4 * noise, TOLERANCE_FLOOR)


def compare(asks: Sequence[Ask], reference: Sequence[Answer], got: Sequence[Answer], tol: float) -> list[str]:
    """The first way each answer of `got` differs from `reference` beyond `tol`, one line a request."""
    problems = []
    for ask, want, have in zip(asks, reference, got, strict=True):
        problem = first_difference(want, have, tol)
        if problem:
            problems.append(f"{ask.label}: {problem} (cached {have.cached})")
    return problems


def first_difference(want: Answer, have: Answer, tol: float) -> str:
    """Where `have` first differs from `want` ("" where it never does): a logprob of a top-k token
    both report off by more than `tol`, a top-k token lost although clear of the k-th, or a token
    (unless `want` had a tie there within `tol`). After a differing token the contexts differ:
    nothing later is compared."""
    if len(have.tokens) != len(want.tokens):
        return f"{len(have.tokens)} tokens, vLLM alone {len(want.tokens)}"
    for position, (want_lp, have_lp) in enumerate(zip(want.logprobs, have.logprobs, strict=True)):
        for token in sorted(set(want_lp) & set(have_lp)):
            if abs(want_lp[token] - have_lp[token]) > tol:
                return (
                    f"position {position}, token {token}: logprob {have_lp[token]:.6f}, vLLM alone "
                    f"{want_lp[token]:.6f} (tolerance {tol:.1e})"
                )
        floor = min(want_lp.values()) if len(want_lp) >= TOP_K else -math.inf
        lost = sorted(t for t in set(want_lp) - set(have_lp) if want_lp[t] > floor + tol)
        if lost:
            return f"position {position}: the top-{TOP_K} lost tokens {lost}"
        if want.tokens[position] != have.tokens[position]:
            ranked = sorted(want_lp.values(), reverse=True)
            if len(ranked) > 1 and ranked[0] - ranked[1] <= tol:
                return ""  # a tie at vLLM alone's own noise: either token is its answer
            return f"position {position}: token {have.tokens[position]}, vLLM alone {want.tokens[position]}"
    return ""


class Sharing:
    """What vLLM alone could have shared: every prompt asked so far, by model, adapter and salt.
    A request's cached tokens may not exceed the longest prefix (in whole pages, below its last
    token) it shares with another request of the same scope asked before it or in its own round
    (requests of one round are scheduled together, in an order vLLM chooses)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, str], list[tuple[int, ...]]] = {}

    @staticmethod
    def _shared(ask: Ask, others: Iterable[tuple[int, ...]]) -> int:
        best = 0
        for other in others:
            common = 0
            for a, b in zip(other, ask.prompt, strict=False):
                if a != b:
                    break
                common += 1
            best = max(best, min(common, len(ask.prompt) - 1) // PAGE * PAGE)
        return best

    def check(self, asks: Sequence[Ask], answers: Sequence[Answer]) -> list[str]:
        """Problems of a round; records the round's prompts."""
        problems = []
        for index, (ask, answer) in enumerate(zip(asks, answers, strict=True)):
            peers = [a.prompt for i, a in enumerate(asks) if i != index and a.scope == ask.scope]
            limit = self._shared(ask, [*self.seen.get(ask.scope, []), *peers])
            if answer.cached > limit:
                problems.append(
                    f"{ask.label}: {answer.cached} cached tokens, vLLM alone could share {limit} "
                    f"(model {ask.model}, adapter {ask.adapter or '-'}, salt {'yes' if ask.salt else 'no'})"
                )
        for ask in asks:
            self.seen.setdefault(ask.scope, []).append(ask.prompt)
        return problems


class Reference:
    """vLLM alone's answers to each round, and how far vLLM alone strays from them when it serves
    the rounds again (its own prefix cache, other batches): the tolerance of every comparison."""

    def __init__(self, llm: Any, adapters: dict[str, str]) -> None:
        self.llm = llm
        self.adapters = adapters
        self.answers: dict[str, list[Answer]] = {}
        self.noise = 0.0

    def of(self, name: str, asks: list[Ask]) -> list[Answer]:
        if name not in self.answers:
            self.answers[name] = run_round(self.llm, asks, self.adapters)
        return self.answers[name]

    def measure(self, rounds: dict[str, list[Ask]]) -> float:
        """Serve every round once more, and a few of its requests twice in a row (the second time
        from vLLM's own prefix cache: the rounds are larger than its pages, so they rarely hit
        there), and keep the largest deviation from the first answers."""
        for name, asks in rounds.items():
            first = self.of(name, asks)
            again = run_round(self.llm, asks, self.adapters)
            self.noise = max(self.noise, *(deviation(a, b) for a, b in zip(first, again, strict=True)))
            warm = asks[:3]
            run_round(self.llm, warm, self.adapters)
            cached = run_round(self.llm, warm, self.adapters)
            assert any(answer.cached for answer in cached), "vLLM's own prefix cache was meant to serve these"
            self.noise = max(self.noise, *(deviation(a, b) for a, b in zip(first, cached, strict=False)))
        return tolerance(self.noise)
