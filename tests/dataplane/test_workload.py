"""The session driver the benchmarks and the demo share (worker.workload.drive): turn order with
and without interleaving, histories, limits and errors; and the demo's client against a stand-in
OpenAI server (streamed chat, usage read into the outcome, a chat's answer in its next turn)."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from worker import workload
from worker.workload import Client, Outcome, drive


def echo(prompt: list[int], max_tokens: int) -> tuple[Outcome, list[int]]:
    """Answers `max_tokens` tokens (the prompt's length each), instantly."""
    outcome = Outcome(ttft_s=0.0, e2e_s=0.0, output_tokens=max_tokens, prompt_tokens=len(prompt), cached_tokens=0)
    return outcome, prompt + [len(prompt)] * max_tokens


def session(index: int, turns: int) -> list[workload.Step[list[int]]]:
    def turn(number: int) -> workload.Step[list[int]]:
        return lambda history: ((history or [index]) + [100 + number], 2)

    return [turn(t) for t in range(turns)]


def test_interleaved_sessions_take_turns_and_see_their_history() -> None:
    sent: list[list[int]] = []

    def send(prompt: list[int], max_tokens: int) -> tuple[Outcome, list[int]]:
        sent.append(prompt)
        return echo(prompt, max_tokens)

    outcomes, wall = drive([session(i, 3) for i in range(3)], send, clients=1)
    assert wall >= 0 and [o.step for o in outcomes] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [p[0] for p in sent] == [0, 1, 2] * 3  # every first turn before any second one
    assert sent[3] == [0, 100, 2, 2, 101]  # the first turn, its answer, the next user message


def test_sessions_run_to_their_end_per_client_without_interleaving() -> None:
    sent: list[list[int]] = []

    def send(prompt: list[int], max_tokens: int) -> tuple[Outcome, list[int]]:
        sent.append(prompt)
        return echo(prompt, max_tokens)

    drive([session(i, 2) for i in range(2)], send, clients=1, interleave=False)
    assert [p[0] for p in sent] == [0, 0, 1, 1]


def test_endless_sessions_stop_at_the_limit_per_client() -> None:
    def endless() -> Iterator[list[workload.Step[list[int]]]]:
        while True:
            yield session(0, 2)

    outcomes, _wall = drive(endless(), echo, clients=2, interleave=False, limit=3)
    assert len(outcomes) == 6


@pytest.mark.parametrize("interleave", [True, False])
def test_the_first_error_stops_every_client_and_is_raised(interleave: bool) -> None:
    def send(prompt: list[int], max_tokens: int) -> tuple[Outcome, list[int]]:
        if prompt[0] == 1:
            raise RuntimeError("refused")
        return echo(prompt, max_tokens)

    with pytest.raises(RuntimeError, match="refused"):
        drive([session(i, 2) for i in range(4)], send, clients=2, interleave=interleave)


class StandIn(BaseHTTPRequestHandler):
    """An OpenAI server's two routes the demo's client uses; it records the chats it gets."""

    chats: list[dict] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "stand-in"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).chats.append({"namespace": self.headers.get("X-Strata-Namespace"), **request})
        usage = {
            "prompt_tokens": 40,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 32, "fragment_tokens": 8},
        }
        events = [
            {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": "an "}}]},
            {"choices": [{"delta": {"content": "answer"}}]},
            {"choices": [], "usage": usage},
        ]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


def test_the_demo_client_drives_chats_through_the_shared_driver() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    StandIn.chats = []
    try:
        client = Client(f"http://127.0.0.1:{server.server_address[1]}")
        stop = threading.Event()
        sessions = workload.conversations(random.Random(0), 10, max_tokens=3, turns=2)
        outcomes, _wall = drive(sessions, client.sender("chat", stop), clients=1, interleave=False, stop=stop, limit=2)
    finally:
        server.shutdown()
    assert [(o.prompt_tokens, o.cached_tokens, o.fragment_tokens, o.output_tokens) for o in outcomes] == [
        (40, 32, 8, 2)
    ] * 2
    first, second = StandIn.chats
    assert first["max_tokens"] == 3 and first["namespace"] in ("acme", "globex")
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][2]["content"] == "an answer"
