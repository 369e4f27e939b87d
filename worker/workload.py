"""The workload driver: sessions of requests, each next request built from the answer before it,
sent by a number of clients at once; and the demo's workloads on it.

A session is a sequence of steps; a step makes a request (a prompt and its answer length) from
what its session holds so far (nothing, or the last request with its answer). `drive` runs
sessions with `clients` requests in flight, through a `send` function that serves one request and
returns its `Outcome` and the session's history after it: the benchmarks send token ids to vLLM's
OpenAI server or to Strata's engine in-process, the demo chat messages to node servers. One
driver, so a workload means the same wherever it runs.

The demo's workloads, run by `make demo`: multi-turn chats and long-document questions against
node servers, and RAG-style requests (shared passages in new orders) against a node that reuses
fragments:

    python -m worker.workload --node http://127.0.0.1:9100 --node http://127.0.0.1:9101 \
        --rag-node http://127.0.0.1:9101

It speaks the OpenAI HTTP API, so it works against any node; it paces itself so a small machine
stays responsive, and logs one line per request (TTFT, cached tokens) so an operator sees reuse."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import random
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

log = logging.getLogger("strata.workload")

Prompt = TypeVar("Prompt")


@dataclasses.dataclass
class Outcome:
    """One request as its client saw it."""

    ttft_s: float
    e2e_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    fragment_tokens: int = 0
    """Prompt tokens served by fragment reuse (a node server's usage reports them)."""
    step: int = 0
    """The request's place in its session (0: a conversation's first turn, which nothing precedes)."""


Step = Callable[[Prompt | None], tuple[Prompt, int]]
"""Given the session's history (None before its first request; else the last prompt with its
answer), the next prompt and its answer length."""
Send = Callable[[Prompt, int], tuple[Outcome, Prompt]]
"""Serve one prompt with this answer length: its outcome and the session's history after it."""


_Place = tuple[Sequence[Step[Prompt]], int, Prompt | None]
"""A session, the index of its next step, and its history so far."""


@dataclasses.dataclass
class _Schedule(Generic[Prompt]):
    """The sessions' steps ready to be sent, shared by the clients of one `drive`."""

    sessions: Iterator[Sequence[Step[Prompt]]]
    ready: collections.deque[_Place[Prompt]] = dataclasses.field(default_factory=collections.deque)
    lock: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    in_flight: int = 0
    errors: list[BaseException] = dataclasses.field(default_factory=list)


def drive(
    sessions: Iterable[Sequence[Step[Prompt]]],
    send: Send[Prompt],
    *,
    clients: int,
    interleave: bool = True,
    stop: threading.Event | None = None,
    pause: float = 0.0,
    limit: int | None = None,
    keep: bool = True,
) -> tuple[list[Outcome], float]:
    """Run every session's steps in order, each after the previous one's answer, `clients`
    requests in flight at once. Returns the outcomes (with `keep`) and the wall time.

    `interleave`: the ready steps are taken round-robin across sessions, every session's first
    step before any next one, so between two turns of a conversation the others run (the sessions
    are read in full first); otherwise each client runs one session to its end, then takes the next
    (the sessions may be endless). `stop` ends the run early; `pause` is each client's wait after
    a request; `limit` the requests each client sends at most. The first error a step or `send`
    raises stops every client and is raised here."""
    schedule: _Schedule[Prompt] = _Schedule(sessions=iter(sessions))
    if interleave:
        schedule.ready.extend((session, 0, None) for session in schedule.sessions)
    halt = stop or threading.Event()
    outcomes: list[Outcome] = []

    def take(own: _Place[Prompt] | None) -> _Place[Prompt] | None:
        """The step this client sends next (None: no more): in turn order, or its own session's next."""
        with schedule.lock:
            if halt.is_set():
                return None
            if not interleave:
                if own is not None and own[1] < len(own[0]) and not schedule.errors:
                    return own
                session = next(schedule.sessions, None) if not schedule.errors else None
                return (session, 0, None) if session is not None else None
            while not schedule.ready and schedule.in_flight and not schedule.errors:
                schedule.lock.wait()
            if not schedule.ready or schedule.errors:
                schedule.lock.notify_all()
                return None
            schedule.in_flight += 1
            return schedule.ready.popleft()

    def client() -> None:
        sent = 0
        current: _Place[Prompt] | None = None
        while not halt.is_set() and (limit is None or sent < limit):
            current = take(current)
            if current is None:
                return
            session, index, history = current
            try:
                prompt, max_tokens = session[index](history)
                outcome, after = send(prompt, max_tokens)
                outcome.step = index
            except BaseException as exc:  # noqa: BLE001 - handed to the caller once every client stops
                with schedule.lock:
                    schedule.errors.append(exc)
                    if interleave:
                        schedule.in_flight -= 1
                    schedule.lock.notify_all()
                return
            sent += 1
            current = (session, index + 1, after)
            with schedule.lock:
                if keep:
                    outcomes.append(outcome)
                if interleave:
                    schedule.in_flight -= 1
                    if index + 1 < len(session):
                        schedule.ready.append(current)
                    schedule.lock.notify_all()
            if pause:
                halt.wait(pause)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, name=f"client-{i}", daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.5)
    if schedule.errors:
        raise schedule.errors[0]
    return outcomes, time.perf_counter() - started


# -- the demo's workloads ------------------------------------------------------------------------------
WORDS = (
    "cache tier block layer token prefix memory bandwidth latency request model attention key value "
    "policy node shard replica storage eviction hotness fragment document clause contract answer"
).split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


Tenants = dict[str, dict[str, str]]
"""Per namespace, the tenant's api_key (the node places its requests by it) and cache_salt (its secret)."""


@dataclasses.dataclass(frozen=True)
class Chat:
    """A chat request of the demo: the tenant's namespace and the messages so far."""

    namespace: str
    messages: list[dict[str, str]]


class Stopped(Exception):
    """The workload was asked to stop while a request waited to be retried."""


class Client:
    def __init__(self, base: str, *, timeout: float = 600.0, tenants: Tenants | None = None) -> None:
        self.base = base.rstrip("/")
        self.timeout = timeout
        self.tenants = tenants or {}
        self.model = self._model()

    def _model(self) -> str:
        with urllib.request.urlopen(self.base + "/v1/models", timeout=30) as response:
            return str(json.loads(response.read())["data"][0]["id"])

    def chat(self, messages: list[dict[str, str]], *, max_tokens: int, namespace: str) -> tuple[str, Outcome]:
        """One streamed chat completion: the answer's text and the request's outcome."""
        # The tenant's API key places the request in its namespace (on either engine); its cache
        # salt keys its blocks (vLLM's cache_salt; Strata's node server ignores it). Without
        # credentials for the namespace, the namespace is named by the header, which a node
        # honours only with STRATA_CLIENT_NAMESPACES.
        payload: dict[str, object] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Content-Type": "application/json"}
        tenant = self.tenants.get(namespace)
        if tenant is not None:
            headers["Authorization"] = f"Bearer {tenant['api_key']}"
            payload["cache_salt"] = tenant["cache_salt"]
        else:
            headers["X-Strata-Namespace"] = namespace
        request = urllib.request.Request(
            self.base + "/v1/chat/completions", data=json.dumps(payload).encode(), headers=headers
        )
        sent = time.perf_counter()
        first = None
        text, usage = "", {}
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece is not None:
                        if first is None and choice.get("delta", {}).get("role") is None:
                            first = time.perf_counter()
                        text += piece
        done = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        return text, Outcome(
            ttft_s=(first or done) - sent,
            e2e_s=done - sent,
            output_tokens=int(usage.get("completion_tokens", 0)),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens", 0)),
            fragment_tokens=int(details.get("fragment_tokens", 0)),
        )

    def sender(self, kind: str, stop: threading.Event) -> Send[Chat]:
        """`drive`'s send for this node: a refused or failed request is retried every 5 s (raising
        Stopped once `stop` is set); each request logs one line; a chat's answer joins its history."""

        def send(chat: Chat, max_tokens: int) -> tuple[Outcome, Chat]:
            while True:
                try:
                    text, outcome = self.chat(chat.messages, max_tokens=max_tokens, namespace=chat.namespace)
                    break
                except urllib.error.HTTPError as exc:
                    detail = exc.read().decode(errors="replace")[:300]
                    log.warning("%s request to %s refused (%s): %s; retrying in 5 s", kind, self.base, exc.code, detail)
                except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
                    log.warning("%s request to %s failed: %s; retrying in 5 s", kind, self.base, exc)
                if stop.wait(5):
                    raise Stopped
            log.info(
                "%-5s %s ns=%-6s prompt=%5d cached=%5d fragment=%5d ttft=%6.0f ms",
                kind,
                self.base.rsplit(":", 1)[-1],
                chat.namespace,
                outcome.prompt_tokens,
                outcome.cached_tokens,
                outcome.fragment_tokens,
                outcome.ttft_s * 1000,
            )
            answer = [{"role": "assistant", "content": text}] if kind == "chat" else []
            return outcome, Chat(chat.namespace, [*chat.messages, *answer])

        return send


def conversations(
    rng: random.Random, system_words: int, *, max_tokens: int, turns: int = 4
) -> Iterator[list[Step[Chat]]]:
    """Endless multi-turn chats (`turns` turns each) that share one system prompt per tenant."""
    systems = {
        ns: "You are the support assistant of " + ns + ". " + _text(random.Random(ns), system_words)
        for ns in ("acme", "globex")
    }

    def conversation(namespace: str) -> list[Step[Chat]]:
        def turn(history: Chat | None) -> tuple[Chat, int]:
            system = [{"role": "system", "content": systems[namespace]}]
            messages = history.messages if history is not None else system
            return Chat(namespace, [*messages, {"role": "user", "content": _text(rng, 40) + "?"}]), max_tokens

        return [turn] * turns

    while True:
        yield conversation(rng.choice(list(systems)))


def documents(rng: random.Random, doc_words: int, *, max_tokens: int, count: int = 3) -> Iterator[list[Step[Chat]]]:
    """Endless questions about a few long documents, in shuffled order."""
    docs = [_text(random.Random(f"doc-{i}"), doc_words) for i in range(count)]

    def ask(_history: Chat | None) -> tuple[Chat, int]:
        doc = rng.choice(docs)
        return Chat(
            "acme", [{"role": "user", "content": "Document:\n" + doc + "\nQuestion: " + _text(rng, 12) + "?"}]
        ), max_tokens

    while True:
        yield [ask]


RAG_NAMESPACE = "rag"


def rag_requests(
    rng: random.Random, passage_words: int, *, max_tokens: int, count: int = 6
) -> Iterator[list[Step[Chat]]]:
    """Endless questions over three of a few shared passages, picked and ordered anew each time: a
    passage is seldom at the same place twice, so only fragment reuse finds it."""
    passages = [f"Passage {i}: " + _text(random.Random(f"passage-{i}"), passage_words) for i in range(count)]

    def ask(_history: Chat | None) -> tuple[Chat, int]:
        chosen = rng.sample(passages, 3)
        question = "Question: " + _text(rng, 10) + "?"
        return Chat(RAG_NAMESPACE, [{"role": "user", "content": "\n".join([*chosen, question])}]), max_tokens

    while True:
        yield [ask]


def run_client(
    client: Client,
    sessions: Iterator[list[Step[Chat]]],
    *,
    kind: str,
    pause: float,
    stop: threading.Event,
    limit: int | None,
) -> None:
    """One demo client: its sessions, one request at a time, `pause` seconds apart, until `stop`
    or `limit` requests (each request logs its own line, no outcome is kept)."""
    with contextlib.suppress(Stopped):
        drive(
            sessions,
            client.sender(kind, stop),
            clients=1,
            interleave=False,
            stop=stop,
            pause=pause,
            limit=limit,
            keep=False,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.workload", description=__doc__.splitlines()[0])
    parser.add_argument("--node", action="append", required=True, help="base URL of a node server (repeat)")
    parser.add_argument("--rag-node", help="base URL of a node that reuses fragments: it also gets RAG requests")
    parser.add_argument("--passage-words", type=int, default=60, help="words per shared passage of the RAG requests")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between a client's requests")
    parser.add_argument("--doc-words", type=int, default=300, help="words per long document")
    parser.add_argument("--system-words", type=int, default=120, help="words in each tenant's system prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=None, help="stop after this many requests per client")
    parser.add_argument(
        "--tenants", help="JSON file of each namespace's api_key and cache_salt (the demo's var/tenants.json)"
    )
    args = parser.parse_args(argv)
    tenants: Tenants = {}
    if args.tenants:
        try:
            with open(args.tenants) as handle:
                tenants = json.load(handle)
        except (OSError, ValueError) as exc:
            parser.error(f"--tenants: cannot read {args.tenants}: {exc}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    clients = []
    deadline = time.monotonic() + 300
    for url in args.node:
        while True:
            try:
                clients.append(Client(url, tenants=tenants))
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    log.error("node %s did not answer within 5 minutes", url)
                    return 1
                stop.wait(2)
    log.info("driving %d node(s): multi-turn chat and long-document QA", len(clients))
    threads = []
    for index, client in enumerate(clients):
        rng = random.Random(index)
        threads.append(
            threading.Thread(
                target=run_client,
                daemon=True,
                kwargs=dict(
                    client=client,
                    sessions=conversations(rng, args.system_words, max_tokens=args.max_tokens),
                    kind="chat",
                    pause=args.pause,
                    stop=stop,
                    limit=args.requests,
                ),
            )
        )
        threads.append(
            threading.Thread(
                target=run_client,
                daemon=True,
                kwargs=dict(
                    client=client,
                    sessions=documents(random.Random(100 + index), args.doc_words, max_tokens=args.max_tokens),
                    kind="doc",
                    pause=args.pause * 2,
                    stop=stop,
                    limit=args.requests,
                ),
            )
        )
    if args.rag_node:
        rag = next((c for c in clients if c.base == args.rag_node.rstrip("/")), None) or Client(
            args.rag_node, tenants=tenants
        )
        log.info("RAG requests (shared passages in new orders, namespace %s) go to %s", RAG_NAMESPACE, rag.base)
        threads.append(
            threading.Thread(
                target=run_client,
                daemon=True,
                kwargs=dict(
                    client=rag,
                    sessions=rag_requests(random.Random(200), args.passage_words, max_tokens=args.max_tokens),
                    kind="rag",
                    pause=args.pause * 2,
                    stop=stop,
                    limit=args.requests,
                ),
            )
        )
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
    except KeyboardInterrupt:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
