"""The offload manager of every engine: finding a prompt's blocks, load or recompute, write-back, quarantine.

Both engines call it: Strata's own transformers engine (`engine.engine.Engine`) and the vLLM
connector (`connectors.vllm`). It decides and records; the bytes it moves are whole blocks handed
to a tier on write-back. Loading into an engine's memory is that engine's loader, and where a
block goes after write-back is the control plane's business (movements).

    fingerprints -> find_prompt (local tiers, then one directory lookup) -> decide -> [engine loads]
    [engine computes] -> store_block (write-back tier; a full host or disk tier evicts by its
        policy, `eviction.local`) ... -> register (one batch, then the evictions) + touch
    a failed load -> quarantine (the directory marks the copy corrupt at once)
    each copy stored, evicted or quarantined -> `copies` (a KV event publisher), where one listens
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from worker.dataplane.checksum import BlockChecksum
from worker.dataplane.counters import Counters
from worker.dataplane.directory import (
    REMOTE,
    TIER_ORDER,
    BlockRegistration,
    BlockTouch,
    Directory,
    PlacementChange,
)
from worker.dataplane.errors import MISSES, BlockCorrupt, BlockUnregistered, TierFull
from worker.dataplane.eviction.local import LocalEvictor, WriteRefused
from worker.dataplane.eviction.rules import Rules, parse_rules
from worker.dataplane.hashing import BlockFingerprint, Fingerprinter, KeyScope, model_key
from worker.dataplane.layout import BlockLayout, ModelProfile, block_layout
from worker.dataplane.offload_records import Chain, Decision, Hit, Throughput, TierLoad
from worker.dataplane.remote_write import RemoteWritePolicy, RemoteWriter
from worker.dataplane.store import TieredStore
from worker.dataplane.tier_names import DEVICE, EVICTING_TIERS, HOST
from worker.dataplane.tiers.base import PutResult, Tier

log = logging.getLogger("strata.engine")

"""Write-back tiers that make room by evicting at once on the node (the device tier is the
working set's; the shared remote tier is the planner's)."""

REPROBE_SECONDS = 30.0
"""How old a tier's speed estimate may grow before a request it would send to recompute loads
instead, to measure the tier again."""


class CopyWatcher(Protocol):
    """Told of the copies a manager adds to its node's tiers or drops from them (vLLM's KV events)."""

    def stored(self, tier: str, keys: Sequence[uuid.UUID]) -> None:
        """`keys` are now held by `tier` (write-back, or a write-through to L3)."""

    def removed(self, tier: str, key: uuid.UUID) -> None:
        """`key` left `tier` (evicted, or dropped as corrupt)."""


class OffloadManager:
    """One model's blocks on one node: its tiers, the directory, and what it has measured of both.

    Thread-safe for what engines do concurrently (lookups, write-backs and quarantines of
    different requests); the speed estimates are plain floats, updated without a lock (a lost
    update only delays what an estimate learns)."""

    def __init__(
        self,
        *,
        store: TieredStore,
        profile: ModelProfile,
        node: str = "local",
        directory: Directory | None = None,
        namespace_salt: Callable[[str], bytes] | None = None,
        counters: Counters | None = None,
        decide: bool = True,
        write_back_tier: str = HOST,
        reprobe_seconds: float | None = REPROBE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.profile = profile
        self.layout: BlockLayout = block_layout(profile)
        if store.layout != self.layout:
            raise ValueError(
                f"the store holds blocks of {store.layout.describe()}, the model needs {self.layout.describe()}"
            )
        if write_back_tier not in store.names:
            raise ValueError(f"write_back_tier: the store has no tier {write_back_tier!r}")
        if reprobe_seconds is not None and not reprobe_seconds > 0:
            raise ValueError(f"reprobe_seconds: a positive number of seconds or None (never), got {reprobe_seconds!r}")
        self.node = node
        self.directory = directory
        if namespace_salt is None:
            namespace_salt = directory.namespace_salt if directory is not None else (lambda name: name.encode())
        self.namespace_salt = namespace_salt
        self.counters = counters if counters is not None else Counters()
        self.decide_enabled = decide
        self.write_back_tier = write_back_tier
        self.remote_writer = RemoteWriter(store=store, layout=self.layout, counters=self.counters)
        """Copies the blocks of write-through classes to L3 at write-back (`register`)."""
        self.model_key = model_key(profile)
        self.reprobe_seconds = reprobe_seconds
        self.clock = clock
        self.tier_speed = {name: Throughput(stale_after=reprobe_seconds) for name in TIER_ORDER}
        self._reprobed_at: dict[str, float] = {}
        self.prefill_speed = Throughput()
        self._fingerprinters: dict[str, Fingerprinter] = {}
        self.copies: CopyWatcher | None = None
        """Told of each copy this manager stores, evicts or quarantines (None: nobody listens)."""
        self.evictor = LocalEvictor(
            model_key=self.model_key, node=node, counters=self.counters, clock=clock, on_evict=self._removed
        )
        self._expired_at = 0.0

    def apply_rules(self, rules: Rules) -> None:
        """Evict from the node's host and disk tiers by `rules` from now on."""
        self.evictor.rules = rules

    def apply_policies(
        self,
        *,
        classes: Sequence[Mapping[str, Any]] = (),
        tiers: Sequence[Mapping[str, Any]] = (),
        quotas: Sequence[Mapping[str, Any]] = (),
        node_group: str = "",
    ) -> Rules:
        """Evict (host, disk, quotas) and write through to L3 as the policies say; all parsed first
        (a bad field raises ValueError naming it, nothing changes). Returns the rules."""
        rules = parse_rules(tiers=tiers, classes=classes, quotas=quotas, node_group=node_group)
        remote = RemoteWritePolicy.from_classes(classes)
        self.apply_rules(rules)
        self.remote_writer.policy = remote
        return rules

    # -- fingerprints ----------------------------------------------------------------------------
    def fingerprinter(self, namespace: str, scope: KeyScope | None = None) -> Fingerprinter:
        """The namespace's fingerprinter under `scope` (a request's adapter and cache salt); raises
        DirectoryUnavailable while the namespace's salt cannot be read. Only the namespace's own
        is kept: a scope holds a tenant's secret, and there may be as many as requests."""
        found = self._fingerprinters.get(namespace)
        if found is None:
            found = Fingerprinter(
                ns_salt=self.namespace_salt(namespace), model_key=self.model_key, block_tokens=self.layout.block_tokens
            )
            self._fingerprinters[namespace] = found
        return found.scoped(scope)

    def knows_salt(self, namespace: str) -> bool:
        """True when `fingerprinter(namespace)` answers without a directory read."""
        return namespace in self._fingerprinters

    def fingerprints(
        self,
        tokens: Sequence[int],
        namespace: str,
        chain: Chain | None = None,
        scope: KeyScope | None = None,
        *,
        known: Sequence[BlockFingerprint] = (),
    ) -> list[BlockFingerprint]:
        """The prompt's blocks as `chain` keys them: the shared lead, then the namespace's own
        blocks chained on from it (the namespace's own chain from the first block without one),
        all under the request's `scope`.

        `known` are fingerprints of the leading blocks of these same tokens computed before under
        the same chain and scope (those `find_prompt` returned): they are taken as they are and
        only the blocks after them are hashed, chained on from the last of them, so a write-back
        of a looked-up prompt hashes nothing again and keys its blocks exactly as the lookup did."""
        own = self.fingerprinter(namespace, scope)
        lead = tuple(chain.lead) if chain is not None else ()
        done = list(known[: len(tokens) // self.layout.block_tokens])
        if len(done) < len(lead):
            done = list(lead)
        if len(done) == len(tokens) // self.layout.block_tokens:
            return done
        if not done:
            return own.blocks(tokens)
        count = len(done)
        skip = count * self.layout.block_tokens
        rest = own.blocks(tokens[skip:], parent=done[-1].prefix_key)
        return done + [dataclasses.replace(fp, index=fp.index + count, start=fp.start + skip) for fp in rest]

    def shared_salts(self, namespace: str) -> dict[str, bytes]:
        """The salts of the shared namespaces other than `namespace` (none without a directory,
        or while it cannot be read: the request then matches its own namespace only)."""
        if self.directory is None:
            return {}
        try:
            salts = self.directory.shared_salts()
        except Exception as exc:  # noqa: BLE001 - an unreadable list of shared namespaces is no shared hit
            log.warning("shared namespaces could not be read, matching the request's own only: %s", exc)
            self.counters.add("lookup_failures")
            return {}
        return {name: salt for name, salt in salts.items() if name != namespace}

    # -- finding a prompt's blocks (the directory's `lookup` is one round trip of it) --------------
    @property
    def local_tiers(self) -> tuple[str, ...]:
        return tuple(name for name in self.store.names if name != REMOTE)

    def locate_local(self, keys: Sequence[uuid.UUID]) -> dict[uuid.UUID, str]:
        """The fastest of this node's own tiers (memory and local files) holding each key."""
        return {key: names[0] for key, names in self.store.locate(keys, tiers=self.local_tiers).items() if names}

    @property
    def verifies_remote(self) -> bool:
        """True when copies read from the shared remote tier must carry the checksum the directory
        registered for their key (`Hit.checksum`): whenever there is a directory. Every node can
        write to L3, so without this check any of them could plant bytes under another tenant's
        key that every node would serve. Without a directory there is no registry to check
        against; a copy's own header is all there is."""
        return self.directory is not None

    def locate_remote(self, keys: Sequence[uuid.UUID], namespace: str) -> dict[uuid.UUID, str]:
        """Which of `keys` the shared remote tier holds, each with the checksum (hex) a copy read
        from there must carry: one directory round trip (or, without a directory, one batched ask
        of the remote tier itself). An outage of either is no hit.

        With a directory, a key is an L3 hit when the directory has a READY copy of it there, and
        the checksum is the one registered for that copy. A key whose best copy the directory
        places in this node's own tiers (which no longer hold it: the caller asked only for what
        they lack) is an L3 hit when the directory also registered a copy in L3 and L3 still holds
        it, with that copy's checksum. Bytes in L3 that the directory registered no copy (with a
        checksum) for are no hit: nothing vouches for them.

        Without a directory the checksum is "": L3 holding the key is all there is to know, and
        a read checks the copy against its own header only (every node that can write to L3
        could have written it)."""
        if not keys or REMOTE not in self.store.names:
            return {}
        found: dict[uuid.UUID, str] = {}
        try:
            if self.directory is not None:
                located = self.directory.lookup(
                    keys=keys, node=self.node, namespace=namespace, model_key=self.model_key
                )
                stale: dict[uuid.UUID, str] = {}
                for key in keys:
                    location = located.location(key)
                    if location is None or not location.remote_checksum:
                        continue
                    if location.tier == REMOTE:
                        found[key] = location.remote_checksum
                    else:
                        stale[key] = location.remote_checksum
                if stale:
                    # The directory's best copy is this node's, which its tiers no longer hold:
                    # the L3 copy behind it serves if L3 still holds it.
                    present = self.store.tier(REMOTE).contains_many(list(stale))
                    found.update((key, stale[key]) for key, here in zip(stale, present, strict=True) if here)
            else:
                present = self.store.tier(REMOTE).contains_many(keys)
                found = {key: "" for key, here in zip(keys, present, strict=True) if here}
        except Exception as exc:  # noqa: BLE001 - an outage of the directory or L3 means recompute
            log.warning("remote lookup failed, treating as a miss: %s", exc)
            self.counters.add("lookup_failures")
        return found

    @staticmethod
    def first_miss(fingerprints: Sequence[BlockFingerprint], found: dict[uuid.UUID, str]) -> int:
        """Index of the first block no tier in `found` holds (chained keys: no hit after it)."""
        return next((i for i, fp in enumerate(fingerprints) if fp.prefix_key not in found), len(fingerprints))

    @staticmethod
    def prefix_hits(
        fingerprints: Sequence[BlockFingerprint],
        found: Mapping[uuid.UUID, str],
        checksums: Mapping[uuid.UUID, str] | None = None,
    ) -> list[Hit]:
        """The leading run of blocks held somewhere (`found`: key -> tier), as hits; a remote
        hit carries its checksum from `checksums` (`locate_remote`)."""
        hits = []
        for fp in fingerprints:
            tier = found.get(fp.prefix_key)
            if tier is None:
                break
            checksum = checksums.get(fp.prefix_key, "") if checksums is not None and tier == REMOTE else ""
            hits.append(Hit(index=fp.index, key=fp.prefix_key, tier=tier, checksum=checksum))
        return hits

    def find_prefix(self, fingerprints: Sequence[BlockFingerprint], namespace: str) -> list[Hit]:
        """The longest run of prompt blocks held somewhere: the node's own tiers first, then one
        directory round trip (or the remote tier itself) for the blocks after the first local miss."""
        found = self.locate_local([fp.prefix_key for fp in fingerprints])
        rest = fingerprints[self.first_miss(fingerprints, found) :]
        remote = self.locate_remote([fp.prefix_key for fp in rest], namespace)
        for key in remote:
            found.setdefault(key, REMOTE)  # a block the node's own tiers hold is read from them
        return self.prefix_hits(fingerprints, found, remote)

    def find_prompt(
        self, tokens: Sequence[int], namespace: str, scope: KeyScope | None = None
    ) -> tuple[list[BlockFingerprint], list[Hit], Chain]:
        """The longest run of the prompt's blocks held anywhere the namespace may read: its own
        chain, or a shared namespace's blocks leading the prompt followed by the namespace's own
        blocks chained on from them (see `Chain`). Returns the winning chain's fingerprints (the
        ones write-back stores under), its hits and the chain; a tie goes to the own chain.

        Everything is keyed under the request's `scope`. A shared namespace's blocks lead only
        requests without a cache salt (a salted request shares KV with its own salt alone, as in
        vLLM), and only those of the request's own adapter."""
        fingerprints = self.fingerprints(tokens, namespace, scope=scope)
        hits = self.find_prefix(fingerprints, namespace)
        best = (fingerprints, hits, Chain())
        if len(hits) == len(fingerprints) or (scope is not None and scope.salt):
            return best
        lead_scope = KeyScope(adapter=scope.adapter) if scope is not None else None
        for shared, salt in sorted(self.shared_salts(namespace).items()):
            printer = Fingerprinter(
                ns_salt=salt, model_key=self.model_key, block_tokens=self.layout.block_tokens
            ).scoped(lead_scope)
            lead_prints = printer.blocks(tokens)
            lead_hits = self.find_prefix(lead_prints, namespace)
            if not lead_hits:
                continue
            chain = Chain(shared=shared, lead=tuple(lead_prints[: len(lead_hits)]))
            chained = self.fingerprints(tokens, namespace, chain, scope=scope)
            own_hits = self.find_prefix(chained[len(lead_hits) :], namespace)
            found = [dataclasses.replace(hit, namespace=shared) for hit in lead_hits] + own_hits
            if len(found) > len(best[1]):
                best = (chained, found, chain)
        if best[2].shared:
            self.counters.add("lookup.shared_hits", len(best[2].lead))
        return best

    # -- deciding --------------------------------------------------------------------------------
    def decide(self, hits: list[Hit], *, prompt_tokens: int, request: str) -> tuple[list[Hit], Decision]:
        """Load the hits or recompute them, whichever the measured speeds say is faster.

        Every decision is counted (`decision.<no_hit|load|recompute>`) and logged in one line with
        the cached tokens, their tiers and both estimates: at INFO when cached tokens are
        recomputed (an operator wants to see a tier too slow to be worth reading), at DEBUG
        otherwise. The tiers read at once (each its share of the blocks), so the load takes as
        long as the slowest tier's share; a tier not measured yet leaves the load time unknown,
        and an unknown time is tried (loaded) so that it gets measured.

        A tier judged too slow is read no more, so its estimate would never learn that the medium
        recovered. Once a tier's estimate is `reprobe_seconds` old, the next request it would send
        to recompute loads instead (one request per tier per interval, counted `decision.reprobe`
        and logged at INFO): that load measures the tier afresh, and a stale estimate is replaced
        by the new reading (`Throughput`), so one re-probe is enough to bring a recovered tier back."""
        tokens = len(hits) * self.layout.block_tokens
        if not hits:
            self.counters.add("decision.no_hit")
            log.debug("request %s: no-hit, 0 of %d prompt tokens cached", request, prompt_tokens)
            return hits, Decision("no-hit")
        blocks = collections.Counter(h.tier for h in hits)
        load_s: float | None = None
        compute_s: float | None = None
        if self.decide_enabled:
            speeds = {name: speed for name in blocks if (speed := self.tier_speed[name].value) is not None}
            if len(speeds) == len(blocks):
                load_s = max(count * self.layout.block_bytes / speeds[name] for name, count in blocks.items())
            if self.prefill_speed.value is not None:
                compute_s = tokens / self.prefill_speed.value
        recompute = load_s is not None and compute_s is not None and load_s > compute_s
        reprobe = self._reprobe_due(blocks) if recompute else ()
        recompute = recompute and not reprobe
        decision = Decision("recompute" if recompute else "load", load_s=load_s, compute_s=compute_s, reprobe=reprobe)
        self.counters.add(f"decision.{decision.choice}")
        if reprobe:
            self.counters.add("decision.reprobe")
        log.log(
            logging.INFO if recompute or reprobe else logging.DEBUG,
            "request %s: %s, %d of %d prompt tokens cached (%s): load %s, recompute %s%s%s",
            request,
            decision.choice,
            tokens,
            prompt_tokens,
            ", ".join(f"{name} {count} blocks" for name, count in blocks.items()),
            _estimate(load_s),
            _estimate(compute_s),
            "" if self.decide_enabled else " (deciding is off)",
            f" (measuring {', '.join(reprobe)} again: estimate older than {self.reprobe_seconds:g}s)"
            if reprobe
            else "",
        )
        return ([] if recompute else hits), decision

    def _reprobe_due(self, tiers: Iterable[str]) -> tuple[str, ...]:
        """The tiers among `tiers` whose estimate is stale and that no request re-probed within
        `reprobe_seconds` (marked as re-probed now, so concurrent requests do not all load)."""
        if self.reprobe_seconds is None:
            return ()
        now = self.clock()
        due = []
        for name in tiers:
            last = self._reprobed_at.get(name)
            if self.tier_speed[name].is_stale(now) and (last is None or now - last >= self.reprobe_seconds):
                self._reprobed_at[name] = now
                due.append(name)
        return tuple(due)

    def observe_load(self, loads: Iterable[TierLoad]) -> None:
        """Learn each tier's speed from a finished load (bytes and seconds per tier that served it)."""
        for served in loads:
            self.tier_speed[served.tier].observe(served.bytes, served.seconds, now=self.clock())

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Learn the engine's prefill speed from a prefill that reused nothing."""
        self.prefill_speed.observe(tokens, seconds)

    # -- write-back ------------------------------------------------------------------------------
    @property
    def target(self) -> Tier:
        """The write-back tier."""
        return self.store.tier(self.write_back_tier)

    def holds(self, keys: Sequence[uuid.UUID]) -> list[bool]:
        """Whether the write-back tier already holds each key (those need no write)."""
        return self.target.contains_many(keys)

    def store_block(
        self,
        *,
        key: uuid.UUID,
        content_key: uuid.UUID,
        position: int,
        namespace: str,
        data: torch.Tensor | None = None,
        fill: Callable[[torch.Tensor], BlockChecksum] | None = None,
    ) -> BlockRegistration | None:
        """Keep one block in the write-back tier and return its registration (None when the
        tier refused it: full or failing, counted and logged, so the caller still registers the
        rest of its batch). The bytes come as `data` (a whole block), or from `fill`, which writes
        them into the memory `Tier.put_from` hands it (the host pool's slot itself: the bytes land
        once)."""
        target = self.target
        if (data is None) == (fill is None):
            raise ValueError("store_block: give the block's bytes (data) or a fill, not both or neither")

        def write() -> PutResult:
            if data is not None:
                return target.put(key, data)
            assert fill is not None
            return target.put_from(key, fill)

        try:
            if target.name in EVICTING_TIERS:
                self.evictor.node = self.node
                result = self.evictor.put(
                    target, key, write, namespace=namespace, position=position, tokens=self.layout.block_tokens
                )
            else:
                result = write()
        except WriteRefused as exc:
            self.counters.add(f"write_back.{target.name}.refused")
            log.warning("write-back refused: %s", exc)
            return None
        except TierFull as exc:
            self.counters.add(f"write_back.{target.name}.full")
            log.warning("write-back skipped: %s", exc)
            return None
        except MISSES as exc:
            self.counters.add(f"write_back.{target.name}.failed")
            log.warning("write-back failed: %s", exc)
            return None
        except OSError as exc:  # a medium's error no tier translated (an eviction's delete): this block only
            self.counters.add(f"write_back.{target.name}.failed")
            log.warning("write-back failed: tier %s: %r", target.name, exc)
            return None
        self.counters.add(f"write_back.{target.name}.stored")
        if self.copies is not None:
            self.copies.stored(target.name, [key])
        return BlockRegistration(
            namespace=namespace,
            model_key=self.model_key,
            prefix_key=key,
            content_key=content_key,
            position=position,
            tokens=self.layout.block_tokens,
            tier=target.name,
            node=None if target.name == REMOTE else self.node,
            nbytes=self.layout.block_bytes,
            checksum=result.checksum.hex if result.checksum else "",
        )

    def register(
        self, registrations: Sequence[BlockRegistration], *, in_remote: Collection[uuid.UUID] = ()
    ) -> Future[None] | None:
        """Record new blocks in the directory in one batch (write-behind); copy those whose class
        writes through, but not those `in_remote` (local copies of L3 hits), to L3 in the
        background (`remote_writer`). Returns the copy's future (None: nothing copied)."""
        if registrations and self.directory is not None:
            self.directory.register(blocks=registrations)
        through = [r for r in registrations if r.prefix_key not in in_remote] if in_remote else registrations
        future = self.remote_writer.submit(through, then=self._register_remote)
        self._expire()
        changes = self.evictor.take_changes()
        if changes and self.directory is not None:
            self.directory.change_placements(changes=changes)
        return future

    def _register_remote(self, registrations: Sequence[BlockRegistration]) -> None:
        if self.copies is not None:
            self.copies.stored(REMOTE, [r.prefix_key for r in registrations])
        if self.directory is not None:
            self.directory.register(blocks=registrations)

    def _removed(self, tier: str, key: uuid.UUID) -> None:
        if self.copies is not None:
            self.copies.removed(tier, key)

    def _expire(self) -> None:
        """Evict blocks idle past their tier's TTL (at most once a second, with a batch)."""
        now = self.clock()
        if now - self._expired_at < 1.0:
            return
        self._expired_at = now
        for name in self.local_tiers:
            if name in EVICTING_TIERS:
                self.evictor.expire(self.store.tier(name))

    def touch(self, namespace: str, keys: Sequence[uuid.UUID]) -> None:
        """Count one access of each reused block (write-behind; feeds the hotness ranking)."""
        if keys and self.directory is not None:
            self.directory.touch(
                touches=[BlockTouch(namespace=namespace, model_key=self.model_key, prefix_key=key) for key in keys]
            )

    def note_hits(self, hits: Sequence[Hit]) -> None:
        """Count one use of each hit in this node's tiers (eviction ranks on them), as part of the
        write-back batch that follows: call it before that batch's `store_block`s."""
        by_tier: dict[str, list[uuid.UUID]] = collections.defaultdict(list)
        for hit in hits:
            by_tier[hit.tier].append(hit.key)
        for tier, keys in by_tier.items():
            self.evictor.touch(tier, keys)

    def touch_hits(self, namespace: str, hits: Sequence[Hit]) -> None:
        """`touch` each hit under the namespace it belongs to (a shared one's, or the request's)."""
        by_namespace: dict[str, list[uuid.UUID]] = collections.defaultdict(list)
        for hit in hits:
            by_namespace[hit.namespace or namespace].append(hit.key)
        for name, keys in by_namespace.items():
            self.touch(name, keys)

    # -- failures --------------------------------------------------------------------------------
    def quarantine(self, key: uuid.UUID, cause: BaseException, namespace: str) -> list[str]:
        """A block that could not be loaded. The copies that failed their checksum (the tier has
        already dropped the bytes) are marked corrupt in the directory at once, so no node is sent
        to them again before the reconciler runs. Returns those tiers.

        A copy in L3 whose checksum is not the registered one (BlockUnregistered: written there
        by someone who did not register it) is dropped here, if L3 still holds those bytes, and
        counted (``remote_unverified``, once per load it failed), besides being marked corrupt."""
        causes = getattr(cause, "causes", ()) or (cause,)
        for exc in causes:
            if isinstance(exc, BlockUnregistered):
                self._drop_unregistered(exc)
        corrupt = sorted({exc.tier for exc in causes if isinstance(exc, BlockCorrupt) and exc.tier != DEVICE})
        for tier in corrupt:
            self.evictor.forget(tier, key)
            self._removed(tier, key)
        if corrupt and self.directory is not None:
            self.directory.change_placements(
                changes=[
                    PlacementChange(
                        namespace=namespace,
                        model_key=self.model_key,
                        prefix_key=key,
                        tier=tier,
                        node=None if tier == REMOTE else self.node,
                        action="corrupt",
                    )
                    for tier in corrupt
                ]
            )
            self.counters.add("quarantined", len(corrupt))
        return corrupt

    def _drop_unregistered(self, error: BlockUnregistered) -> None:
        self.counters.add("remote_unverified")
        try:
            dropped = self.store.drop_unregistered(error)
        except Exception as exc:  # noqa: BLE001 - the copy stays refused by every reader that checks
            log.warning("could not drop the unregistered copy of block %s from %s: %s", error.key, error.tier, exc)
            return
        log.warning(
            "block %s in tier %s carries checksum %s, not the registered %s: refused%s; quarantined",
            error.key,
            error.tier,
            error.stored or "(none)",
            error.registered,
            ", dropped" if dropped else "",
        )


def _estimate(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"~{seconds:.4f}s"
