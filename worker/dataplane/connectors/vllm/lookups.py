"""The scheduler half's lookups: what a lookup found for a request (`Plan`), the request as the
scheduler half follows it (`Tracked`), and the lookups themselves (`Lookups`), answered at once
where the node's own tiers hold every block (or there is no directory to ask), else on a thread
of their own, so that vLLM's scheduler loop never waits on the database.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from worker.dataplane.blend.matching import Fragment
from worker.dataplane.connectors.vllm.metadata import LoadSpec
from worker.dataplane.connectors.vllm.requests import AdapterDigests, AdapterUnreadable, scope_of
from worker.dataplane.directory import DirectoryUnavailable
from worker.dataplane.hashing import BlockFingerprint, KeyScope
from worker.dataplane.offload import OffloadManager
from worker.dataplane.offload_records import Decision, Hit, RequestTrace
from worker.dataplane.tier_names import REMOTE

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("strata.vllm")


@dataclasses.dataclass
class Plan:
    """What a lookup found for a request: its blocks' keys, how many leading blocks some tier
    holds, and the hits the manager decided to load."""

    fingerprints: list[BlockFingerprint]
    held: int
    hits: list[Hit]
    decision: Decision
    lookup_s: float


@dataclasses.dataclass(frozen=True)
class Blend:
    """A request's blended load: its exact prefix [0, prefix_len) (whole blocks), the fragments
    after it, where the load ends, and the r it is blended at."""

    prefix_len: int
    fragments: list[Fragment]
    end: int
    percent: float


@dataclasses.dataclass
class Tracked:
    """A request as the scheduler's half follows it, from its first lookup to its end."""

    request: Request
    namespace: str | None
    """None: the request is served uncached (`trace.uncached` says why)."""
    trace: RequestTrace
    scope: KeyScope | None = None
    """Its adapter and cache salt, once known (the adapter's digest may take a lookup thread)."""
    fingerprints: list[BlockFingerprint] = dataclasses.field(default_factory=list)
    plan: Plan | None = None
    pending: Future[Plan] | None = None
    pending_since: float = 0.0
    """When its lookup started (perf_counter): past `lookup_deadline_seconds` it is given up."""
    load_tokens: int = 0
    load: LoadSpec | None = None
    stored: int = 0
    """Leading blocks known to be stored (held before, or saved since)."""
    pages: list[int] = dataclasses.field(default_factory=list)
    scheduled: bool = False
    first_step_at: float = 0.0
    prefilled: bool = False
    hit_end: int = 0
    """Where the tokens Strata can load end (the last lookup's answer)."""
    asynchronous: bool = False
    """Its load runs outside the engine step (a hit in an `async_load_tiers` tier)."""
    recompute: bool = False
    """A load of it failed: it loads nothing more (vLLM recomputes it)."""
    local_tokens: int = 0
    """The tokens vLLM's own prefix cache held when its load was offered (where the load starts)."""
    loading: bool = False
    """Its asynchronous load was handed to the worker and has not been reported yet."""
    blend: Blend | None = None
    """Its blended load (`fragments`), once its plan is known and fragments were found."""
    blend_checked: bool = False
    """Fragments were looked for since its plan was made."""
    blended: bool = False
    """Its pages hold blended KV from its load on: never put back into vLLM's prefix cache."""
    saves_until: int | None = None
    """Blocks from this index on are never saved (computed over blended KV)."""
    blend_search: Future[Blend | None] | None = None
    """Its fragment search, while it runs on the finder's thread (`fragments`)."""
    blend_search_since: float = 0.0
    unshared: tuple[int, list[int]] | None = None
    """Its synchronous load's pages out of vLLM's prefix cache until the load is reported: (the
    first of them, its page table), `shared_pages`."""


class Lookups:
    """A request's lookup: here when no round trip is needed, else on one of two threads."""

    def __init__(
        self, manager: OffloadManager, adapters: AdapterDigests, *, uncached: Callable[[RequestTrace, str], None]
    ) -> None:
        self.manager = manager
        self.adapters = adapters
        self.uncached = uncached
        """Serve a request without the cache, counting why (an adapter it cannot read)."""
        self.threads = ThreadPoolExecutor(2, thread_name_prefix="strata-lookup")

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)

    def start(self, tracked: Tracked) -> Future[Plan]:
        """The lookup, here if it needs no round trip (the namespace's salt and the adapter's
        digest are known and the node's own tiers answer for every block, or there is no
        directory to ask: nothing remote, no shared namespace), else on a lookup thread."""
        tokens = list(tracked.request.all_token_ids)
        namespace = tracked.namespace
        assert namespace is not None
        manager = self.manager
        if tracked.scope is None:
            tracked.scope = scope_of(tracked.request, self.adapters, wait=False)
        if tracked.scope is not None and manager.knows_salt(namespace):
            fingerprints = manager.fingerprints(tokens, namespace, scope=tracked.scope)
            found = manager.locate_local([fp.prefix_key for fp in fingerprints])
            alone = REMOTE not in manager.store.names and manager.directory is None
            if manager.first_miss(fingerprints, found) == len(fingerprints) or alone:
                done: Future[Plan] = Future()
                done.set_result(self._plan(tracked, fingerprints, found, time.perf_counter()))
                return done
        return self.threads.submit(self._lookup, tracked, tokens, time.perf_counter())

    def _lookup(self, tracked: Tracked, tokens: list[int], started: float) -> Plan:
        namespace = tracked.namespace
        assert namespace is not None
        try:
            if tracked.scope is None:
                tracked.scope = scope_of(tracked.request, self.adapters, wait=True)
            # The namespace's own chain, or a shared namespace's blocks leading the prompt; the
            # blocks saved later continue whichever chain won (`_continue`).
            fingerprints, held, _ = self.manager.find_prompt(tokens, namespace, scope=tracked.scope)
        except AdapterUnreadable as exc:
            log.warning("request %s runs without the cache: %s", tracked.request.request_id, exc)
            self.uncached(tracked.trace, "adapter")
            tracked.namespace = None
            return Plan([], 0, [], Decision("no-hit"), time.perf_counter() - started)
        except (DirectoryUnavailable, ValueError) as exc:  # the database is down; an unknown namespace
            log.warning("request %s runs without the cache: %s", tracked.request.request_id, exc)
            self.manager.counters.add("lookup_failures")
            return Plan([], 0, [], Decision("no-hit"), time.perf_counter() - started)
        except Exception:  # noqa: BLE001 - a lookup that fails is a miss, never an engine error
            log.exception("request %s: lookup failed, recomputing", tracked.request.request_id)
            self.manager.counters.add("lookup_failures")
            return Plan([], 0, [], Decision("no-hit"), time.perf_counter() - started)
        return self._decided(tracked, fingerprints, held, started)

    def _plan(
        self, tracked: Tracked, fingerprints: list[BlockFingerprint], found: dict[uuid.UUID, str], started: float
    ) -> Plan:
        return self._decided(tracked, fingerprints, self.manager.prefix_hits(fingerprints, found), started)

    def _decided(self, tracked: Tracked, fingerprints: list[BlockFingerprint], held: list[Hit], started: float) -> Plan:
        hits, decision = self.manager.decide(
            list(held), prompt_tokens=tracked.request.num_tokens, request=tracked.request.request_id
        )
        return Plan(fingerprints, len(held), hits, decision, time.perf_counter() - started)
