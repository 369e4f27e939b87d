"""A workload driver for the demo: multi-turn chats and long-document questions against node servers,
and RAG-style requests (shared passages in new orders) against a node that reuses fragments.

    python -m worker.workload --node http://127.0.0.1:9100 --node http://127.0.0.1:9101 \
        --rag-node http://127.0.0.1:9101

It speaks the OpenAI HTTP API, so it works against any node; it paces itself so a small machine
stays responsive, and logs one line per request (TTFT, cached tokens) so an operator sees reuse."""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

log = logging.getLogger("strata.workload")

WORDS = (
    "cache tier block layer token prefix memory bandwidth latency request model attention key value "
    "policy node shard replica storage eviction hotness fragment document clause contract answer"
).split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


Tenants = dict[str, dict[str, str]]
"""Per namespace, the tenant's api_key (the node places its requests by it) and cache_salt (its secret)."""


class Client:
    def __init__(self, base: str, *, timeout: float = 600.0, tenants: Tenants | None = None) -> None:
        self.base = base.rstrip("/")
        self.timeout = timeout
        self.tenants = tenants or {}
        self.model = self._model()

    def _model(self) -> str:
        with urllib.request.urlopen(self.base + "/v1/models", timeout=30) as response:
            return str(json.loads(response.read())["data"][0]["id"])

    def chat(self, messages: list[dict[str, str]], *, max_tokens: int, namespace: str) -> tuple[str, dict, float]:
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
        return text, usage, (first or time.perf_counter()) - sent


def conversations(rng: random.Random, system_words: int) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """Endless multi-turn chats (4 turns each) that share one system prompt per tenant."""
    systems = {
        ns: "You are the support assistant of " + ns + ". " + _text(random.Random(ns), system_words)
        for ns in ("acme", "globex")
    }
    while True:
        namespace = rng.choice(list(systems))
        messages = [{"role": "system", "content": systems[namespace]}]
        for _ in range(4):
            messages.append({"role": "user", "content": _text(rng, 40) + "?"})
            yield namespace, messages


def documents(rng: random.Random, doc_words: int, count: int = 3) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """Endless questions about a few long documents, in shuffled order."""
    docs = [_text(random.Random(f"doc-{i}"), doc_words) for i in range(count)]
    while True:
        doc = rng.choice(docs)
        yield "acme", [{"role": "user", "content": "Document:\n" + doc + "\nQuestion: " + _text(rng, 12) + "?"}]


RAG_NAMESPACE = "rag"


def rag_requests(rng: random.Random, passage_words: int, count: int = 6) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """Endless questions over three of a few shared passages, picked and ordered anew each time: a
    passage is seldom at the same place twice, so only fragment reuse finds it."""
    passages = [f"Passage {i}: " + _text(random.Random(f"passage-{i}"), passage_words) for i in range(count)]
    while True:
        chosen = rng.sample(passages, 3)
        question = "Question: " + _text(rng, 10) + "?"
        yield RAG_NAMESPACE, [{"role": "user", "content": "\n".join([*chosen, question])}]


def drive(
    client: Client,
    stream: Iterator[tuple[str, list[dict[str, str]]]],
    *,
    kind: str,
    pause: float,
    max_tokens: int,
    stop: threading.Event,
    limit: int | None,
) -> int:
    done = 0
    for namespace, messages in stream:
        if stop.is_set() or (limit is not None and done >= limit):
            break
        try:
            text, usage, ttft = client.chat(messages, max_tokens=max_tokens, namespace=namespace)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            log.warning("%s request to %s refused (%s): %s; retrying in 5 s", kind, client.base, exc.code, detail)
            stop.wait(5)
            continue
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
            log.warning("%s request to %s failed: %s; retrying in 5 s", kind, client.base, exc)
            stop.wait(5)
            continue
        if messages[-1]["role"] == "user" and kind == "chat":
            messages.append({"role": "assistant", "content": text})
        details = usage.get("prompt_tokens_details") or {}
        log.info(
            "%-5s %s ns=%-6s prompt=%5d cached=%5d fragment=%5d ttft=%6.0f ms",
            kind,
            client.base.rsplit(":", 1)[-1],
            namespace,
            usage.get("prompt_tokens", 0),
            details.get("cached_tokens", 0),
            details.get("fragment_tokens", 0),
            ttft * 1000,
        )
        done += 1
        stop.wait(pause)
    return done


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
                target=drive,
                daemon=True,
                kwargs=dict(
                    client=client,
                    stream=conversations(rng, args.system_words),
                    kind="chat",
                    pause=args.pause,
                    max_tokens=args.max_tokens,
                    stop=stop,
                    limit=args.requests,
                ),
            )
        )
        threads.append(
            threading.Thread(
                target=drive,
                daemon=True,
                kwargs=dict(
                    client=client,
                    stream=documents(random.Random(100 + index), args.doc_words),
                    kind="doc",
                    pause=args.pause * 2,
                    max_tokens=args.max_tokens,
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
                target=drive,
                daemon=True,
                kwargs=dict(
                    client=rag,
                    stream=rag_requests(random.Random(200), args.passage_words),
                    kind="rag",
                    pause=args.pause * 2,
                    max_tokens=args.max_tokens,
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
