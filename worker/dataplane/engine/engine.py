"""Cache-aware generation: fingerprint -> lookup -> layer-wise load -> prefill the rest -> decode -> write back
(`write_back.BlockWriter`: the new blocks into the write-back tier and the device working set).

Why one module: one request's path, from its fingerprints to its last token, with the fragment
reuse that decides what prefill recomputes; the parts that stand alone (the layer loader in
`layer_loader`, the loaded prefix's cache and attention in `prefix`, the model in `models`,
write-back, the working set, turns, fragment matching in `blend`) live in modules of their own.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from worker.dataplane.blend.fusion import BlendPlan, blend_prefill
from worker.dataplane.blend.matching import (
    ContentIndex,
    Fragment,
    check_segments,
    choose,
    content_keys_at,
    directory_fragments,
    gaps,
    segment_windows,
)
from worker.dataplane.blend.options import BlendOptions
from worker.dataplane.blend.rope import rope_problem
from worker.dataplane.blend.tuner import BLEND, BlendTuner
from worker.dataplane.counters import Counters
from worker.dataplane.directory import (
    REMOTE,
    Directory,
    DirectoryUnavailable,
)
from worker.dataplane.engine.turns import Step, Turns
from worker.dataplane.engine.working_set import ClassShare, WorkingSet
from worker.dataplane.engine.write_back import BlockWriter
from worker.dataplane.eviction.rules import Rules
from worker.dataplane.hashing import BlockFingerprint, Fingerprinter
from worker.dataplane.layer_loader.loader import LayerLoader, PrefixBuffers
from worker.dataplane.layout import block_layout
from worker.dataplane.models.loading import LoadedModel
from worker.dataplane.offload import REPROBE_SECONDS, OffloadManager
from worker.dataplane.offload_records import Chain, Hit, RequestTrace, Throughput
from worker.dataplane.prefix.cache import LoadDeadline, LoadFailed, StrataCache
from worker.dataplane.store import TieredStore
from worker.dataplane.tier_names import DEVICE, HOST
from worker.dataplane.traffic import TrafficMeter

log = logging.getLogger("strata.engine")

WRITE_THROUGH_WAIT_SECONDS = 5.0
"""How long a request waits for its write-through copies to L3 before it answers anyway."""


@dataclasses.dataclass
class GenerationResult:
    output_ids: list[int]
    trace: RequestTrace
    first_logits: torch.Tensor
    """Logits of the last prompt position (what chose the first output token)."""
    cache: StrataCache | None = None
    """The request's KV cache after decoding, when asked for with `keep_cache`."""


class Sampler:
    """Greedy at temperature 0; otherwise softmax sampling at that temperature from a seeded generator."""

    def __init__(self, *, temperature: float, seed: int | None) -> None:
        self.temperature = temperature
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def pick(self, logits: torch.Tensor) -> int:
        if self.temperature == 0:
            return int(torch.argmax(logits))
        # In float64, shifted so the largest logit is 0: a temperature as small as 1e-300 still
        # gives a distribution (the most likely token), not inf/inf.
        scaled = logits.double().cpu()
        probs = torch.softmax((scaled - scaled.max()) / self.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


@dataclasses.dataclass
class EngineOptions:
    block_tokens: int = 256
    layerwise: bool = True
    write_back_tier: str = HOST
    keep_in_device: bool = True
    """Keep new and reused blocks in the device pool (LRU within its capacity)."""
    decide: bool = True
    """Choose per request between loading hits and recomputing them, from measured speeds."""
    blend: BlendOptions = dataclasses.field(default_factory=BlendOptions)
    """Fragment reuse beyond the prefix (off unless `blend.enabled`)."""
    reprobe_seconds: float | None = REPROBE_SECONDS
    """How old a tier's speed estimate may grow before a request it would recompute loads instead,
    to measure the tier again (None: never; a tier judged too slow then stays unread)."""
    content_index_entries: int = 1 << 20
    """Most content keys the node remembers for fragment matching (least recently used go first)."""
    lookup_deadline_s: float = 5.0
    """Longest a request waits for its lookup; past it the request is served without the cache's
    hits (counted ``lookup_deadlines``)."""
    load_deadline_s: float = 30.0
    """Longest a request's load may take, as its layers wait for it; past it the load is given
    up and the tokens recomputed (counted ``load_deadlines``)."""

    def __post_init__(self) -> None:
        for name in ("lookup_deadline_s", "load_deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be greater than zero, got {getattr(self, name)!r}")


class Engine:
    """One model on one node, its tiers, and (optionally) the directory shared by all nodes.

    Concurrent requests take turns at the model step by step (`turns.Turns`): a waiting prefill
    goes before the next decode step of another request, so a new request's first token does not
    wait for whole answers. Each step has the engine to itself: callers never see each other's
    state."""

    def __init__(
        self,
        *,
        model: LoadedModel,
        store: TieredStore,
        node: str = "local",
        directory: Directory | None = None,
        namespace_salt: Callable[[str], bytes] | None = None,
        options: EngineOptions | None = None,
        counters: Counters | None = None,
        on_trace: Callable[[RequestTrace], None] | None = None,
        turns: Turns | None = None,
    ) -> None:
        """`turns`: engines that compute on one device share its turns (several nodes served from
        one process on one machine's CPUs take turns as one node's requests do); by default the
        engine has the model to itself."""
        self.model = model
        self.store = store
        self.options = options or EngineOptions()
        self.counters = counters or Counters()
        self.on_trace = on_trace
        self.profile = model.profile(self.options.block_tokens)
        self.layout = block_layout(self.profile)
        # Lookup, the load-or-recompute decision, write-back to the tiers below L1 and quarantine:
        # the same manager the vLLM connector calls.
        self.offload = OffloadManager(
            store=store,
            profile=self.profile,
            node=node,
            directory=directory,
            namespace_salt=namespace_salt,
            counters=self.counters,
            decide=self.options.decide,
            write_back_tier=self.options.write_back_tier,
            reprobe_seconds=self.options.reprobe_seconds,
        )
        self.model_key = self.offload.model_key
        self._turns = turns if turns is not None else Turns()
        # Lookups that may wait on the network (the directory, L3) run here, so that a request
        # waits for its lookup at most lookup_deadline_s, and outside its turn at the model.
        self._lookups = ThreadPoolExecutor(4, thread_name_prefix="strata-lookup")
        self._ids = itertools.count(1)
        # L1: the blocks kept in the device tier, each priority class within its share.
        self.working_set = WorkingSet(store.tier(DEVICE), counters=self.counters) if DEVICE in store.names else None
        self.traces: collections.deque[RequestTrace] = collections.deque(maxlen=200)
        # Arrivals, prompt lengths, requests in flight and L1 pressure, for the heartbeat.
        self.traffic = TrafficMeter(pressure=self.l1_pressure)
        self.content_index = ContentIndex(self.options.content_index_entries)
        self.writer = BlockWriter(
            offload=self.offload,
            store=store,
            layout=self.layout,
            working_set=self.working_set,
            content_index=self.content_index,
            keep_in_device=self.options.keep_in_device,
        )
        self.blend_options = self.options.blend
        self.tuner: BlendTuner | None = None
        if self.blend_options.enabled:
            problem = rope_problem(model.model.model.rotary_emb)
            if problem is not None:
                raise ValueError(f"blend: fragments of model {model.name} cannot be re-aligned: {problem}")
            if self.blend_options.check_layer >= model.layers and self.blend_options.selection == "deviation":
                raise ValueError(
                    f"blend: check_layer {self.blend_options.check_layer} is past the model's {model.layers} layers"
                )
            self.tuner = BlendTuner(
                options=self.blend_options,
                full_prefill=self.full_prefill_logits,
                counters=self.counters,
                model=model.name,
            )

    # -- public -------------------------------------------------------------------------------
    def apply_policies(
        self,
        *,
        version: int = 0,
        classes: Sequence[Mapping[str, Any]] = (),
        tiers: Sequence[Mapping[str, Any]] = (),
        quotas: Sequence[Mapping[str, Any]] = (),
        node_group: str = "",
    ) -> Rules:
        """Enforce the control plane's policies on this node: the host and disk tiers' eviction,
        quotas and write-through classes at write-back (`OffloadManager.apply_policies`), and the device working set's
        rule and class shares. Every field is parsed first; a bad one raises ValueError naming
        it, and nothing is applied."""
        shares = []
        for i, item in enumerate(classes):
            try:
                shares.append(ClassShare.from_dict(dict(item)))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"classes[{i}].{exc}") from None
        rules = self.offload.apply_policies(classes=classes, tiers=tiers, quotas=quotas, node_group=node_group)
        if self.working_set is not None:
            self.working_set.set_shares(shares, version=version)
            self.working_set.set_rule(rules.tier(DEVICE), weights=rules.weights, default_weight=rules.default_weight)
        return rules

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        namespace: str = "default",
        use_cache: bool = True,
        layerwise: bool | None = None,
        stop_ids: Sequence[int] = (),
        on_token: Callable[[int], bool] | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        segments: Sequence[Sequence[int]] | None = None,
        blend: bool | None = None,
        write_back: bool = True,
        keep_cache: bool = False,
    ) -> GenerationResult:
        """Generate up to `max_tokens` tokens after `prompt_ids`: greedy at temperature 0, else
        sampled (reproducibly with `seed`). `on_token` sees each token and returns True to stop.

        `segments` marks [start, end) token ranges of the prompt that are independent passages (as
        RAG prompts are built): their blocks are stored aligned to them for later fragment reuse.
        `blend` False turns fragment reuse off for this request (prefix reuse only). `write_back`
        False reads the cache without adding to it (quality comparisons on a fixed cache)."""
        if not prompt_ids:
            raise ValueError("prompt: at least one token is needed")
        marked = check_segments(segments, len(prompt_ids))
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1, got {max_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature: cannot be negative, got {temperature}")
        if len(prompt_ids) + max_tokens > self.model.max_context:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens + max_tokens {max_tokens} exceed the model's context of "
                f"{self.model.max_context}"
            )
        trace = RequestTrace(
            request_id=f"req-{next(self._ids)}",
            namespace=namespace,
            prompt_tokens=len(prompt_ids),
            started_at=time.time(),
            layerwise=self.options.layerwise if layerwise is None else layerwise,
        )
        trace.segments = len(marked)
        sampler = Sampler(temperature=temperature, seed=seed)
        use_blend = self.tuner is not None and blend is not False
        self.traffic.arrive(len(prompt_ids))
        copies: list[Future[None]] = []
        try:
            output, logits, cache = self._generate(
                list(prompt_ids),
                max_tokens,
                namespace,
                use_cache,
                trace,
                set(stop_ids),
                on_token,
                sampler,
                marked,
                use_blend,
                write_back,
                copies,
            )
            # Write-through means written before the answer: the copies to L3 ran beside the
            # decode steps, off the engine's turn; what is left of them is waited for here.
            self.offload.remote_writer.wait(copies, timeout=WRITE_THROUGH_WAIT_SECONDS)
        finally:
            self.traffic.finish()
        return GenerationResult(
            output_ids=output, trace=trace, first_logits=logits.float().cpu(), cache=cache if keep_cache else None
        )

    def l1_pressure(self) -> float:
        """The device working set's use over its capacity (0 without a device tier)."""
        ws = self.working_set
        return ws.used_bytes() / ws.capacity_bytes if ws is not None and ws.capacity_bytes else 0.0

    def full_prefill_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Logits of the last position of a plain prefill (no cache), queued behind the requests."""
        with self._turns.hold(Step.BACKGROUND), torch.inference_mode():
            ids = torch.tensor([list(prompt)], device=self.model.device)
            return self.model.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float().cpu()

    def close(self) -> None:
        """Stop the background quality checker and the lookup threads."""
        if self.tuner is not None:
            self.tuner.close()
        self._lookups.shutdown(wait=False, cancel_futures=True)

    def fingerprinter(self, namespace: str) -> Fingerprinter:
        return self.offload.fingerprinter(namespace)

    @property
    def node(self) -> str:
        return self.offload.node

    @node.setter
    def node(self, name: str) -> None:
        self.offload.node = name

    @property
    def directory(self) -> Directory | None:
        return self.offload.directory

    @directory.setter
    def directory(self, directory: Directory | None) -> None:
        self.offload.directory = directory

    @property
    def tier_speed(self) -> dict[str, Throughput]:
        """The measured read speed of each tier (bytes/s), as the load-or-recompute decision sees it."""
        return self.offload.tier_speed

    @property
    def prefill_speed(self) -> Throughput:
        """The measured prefill speed (tokens/s) of requests that reused nothing."""
        return self.offload.prefill_speed

    # -- the request path ---------------------------------------------------------------------
    def _generate(
        self,
        prompt: list[int],
        max_tokens: int,
        namespace: str,
        use_cache: bool,
        trace: RequestTrace,
        stop_ids: set[int],
        on_token: Callable[[int], bool] | None,
        sampler: Sampler,
        segments: list[tuple[int, int]],
        use_blend: bool,
        write_back: bool,
        copies: list[Future[None]],
    ) -> tuple[list[int], torch.Tensor, StrataCache]:
        start = time.perf_counter()
        fingerprints: list[BlockFingerprint] = []
        hits: list[Hit] = []
        chain = Chain()
        if use_cache:
            fingerprints, hits, chain, use_cache = self._look_up(prompt, namespace, trace)
        trace.lookup_s = time.perf_counter() - start
        with self._turns.hold(Step.PREFILL), torch.inference_mode():
            cache, logits, hits, fragments, percent, exact_until, kept = self._first_token(
                prompt, namespace, use_cache, trace, use_blend, segments, looked_up=(hits, chain, start)
            )
        if len(kept.lead) < len(chain.lead):
            # A shared block failed to load: the blocks from it on are keyed as the request's own.
            fingerprints = fingerprints[: len(kept.lead)]
        chain = kept
        # The prompt's blocks are stored before decoding starts, so a request over the same
        # document that prefills between this one's decode steps already finds them.
        early = use_cache and write_back and not use_blend
        if early:
            with self._turns.hold(Step.WRITE_BACK), torch.inference_mode():
                if copy := self.writer.write_back(
                    prompt, hits, cache, namespace, trace, chain=chain, fingerprints=fingerprints
                ):
                    copies.append(copy)
        output = self._decode(cache, logits, max_tokens, trace, stop_ids, on_token, sampler)
        with self._turns.hold(Step.WRITE_BACK), torch.inference_mode():
            if fragments and self.tuner is not None:
                self.tuner.offer(namespace, prompt, logits, percent)
            if use_cache and write_back:
                # (hits were touched by the early write-back; they all lie in the prompt)
                copy = self.writer.write_back(
                    prompt + output[:-1],
                    [] if early else hits,
                    cache,
                    namespace,
                    trace,
                    exact_until=exact_until,
                    segments=segments if use_blend else [],
                    fragments_too=use_blend,
                    stored_until=len(prompt) if early else 0,
                    chain=chain,
                    fingerprints=fingerprints,
                )
                if copy is not None:
                    copies.append(copy)
            self.traces.append(trace)
            if self.on_trace is not None:
                self.on_trace(trace)
        return output, logits, cache

    def _look_up(
        self, prompt: list[int], namespace: str, trace: RequestTrace
    ) -> tuple[list[BlockFingerprint], list[Hit], Chain, bool]:
        """The prompt's fingerprints (write-back keys its blocks with them, hashing none again), its
        hits and the chain its blocks are stored under (`OffloadManager.find_prompt`),
        looked up before the request takes its turn at the model, so that a slow directory or L3
        delays this request only. A lookup that may wait on the network runs on a lookup thread,
        waited for at most `lookup_deadline_s`: past it the request is served without hits
        (counted ``lookup_deadlines``), its blocks still stored when its namespace's salt is
        known. The last value is False when the request must be served uncached: without the
        namespace's salt nothing can be matched or stored."""
        if self.offload.directory is None and REMOTE not in self.store.names:
            fingerprints, hits, chain = self.offload.find_prompt(prompt, namespace)  # memory and files only
            return fingerprints, hits, chain, True
        lookup = self._lookups.submit(self.offload.find_prompt, prompt, namespace)
        try:
            fingerprints, hits, chain = lookup.result(timeout=self.options.lookup_deadline_s)
        except TimeoutError:
            lookup.cancel()
            self.counters.add("lookup_deadlines")
            log.warning(
                "request %s: no lookup answer within %g s; served without the cache's hits",
                trace.request_id,
                self.options.lookup_deadline_s,
            )
            return [], [], Chain(), self.offload.knows_salt(namespace)
        except DirectoryUnavailable as exc:
            log.warning("request %s runs without the cache: %s", trace.request_id, exc)
            self.counters.add("lookup_failures")
            return [], [], Chain(), False
        return fingerprints, hits, chain, True

    def _first_token(
        self,
        prompt: list[int],
        namespace: str,
        use_cache: bool,
        trace: RequestTrace,
        use_blend: bool,
        segments: Sequence[tuple[int, int]] = (),
        *,
        looked_up: tuple[list[Hit], Chain, float],
    ) -> tuple[StrataCache, torch.Tensor, list[Hit], list[Fragment], float, int | None, Chain]:
        """The load-or-recompute decision and the prefill, after the lookup (`looked_up`: its
        hits, chain and start): the logits of the first token, and the chain of keys the
        prompt's blocks are stored under (`OffloadManager.find_prompt`)."""
        hits, chain, start = looked_up
        self.counters.add("lookup_tokens", len(prompt))
        hits, decision = self.offload.decide(hits, prompt_tokens=len(prompt), request=trace.request_id)
        trace.decision = decision.choice
        fragments: list[Fragment] = []
        percent = 0.0
        if use_cache and use_blend:
            assert self.tuner is not None
            mode, percent = self.tuner.current(namespace)
            trace.blend, trace.blend_percent = mode, percent
            matching = time.perf_counter()
            if mode == BLEND:
                fragments = self._match_fragments(prompt, len(hits) * self.layout.block_tokens, namespace, segments)
                if not fragments:
                    trace.blend = "no-fragment"
            trace.lookup_s += time.perf_counter() - matching
        exact_until: int | None = None
        while True:
            try:
                if fragments:
                    cache, logits = self._blend_prefill(prompt, hits, fragments, percent, trace)
                    exact_until = fragments[0].start
                else:
                    cache, logits = self._prefill(prompt, hits, trace)
                break
            except LoadFailed as failure:
                # A vanished or corrupt block is a miss: recompute from it, never serve it. So is
                # one a tier did not deliver by the load's deadline.
                trace.load_failures += 1
                self.counters.add("load_failures")
                if isinstance(failure.cause, LoadDeadline):
                    self.counters.add("load_deadlines")
                if failure.block_index < len(hits):
                    failed = hits[failure.block_index]
                    self._forget(failed, failure.cause, failed.namespace or namespace)
                    hits = hits[: failure.block_index]
                    # The blocks after a shared block that failed are stored as the request's own.
                    chain = dataclasses.replace(chain, lead=chain.lead[: failure.block_index])
                elif failure.block_index - len(hits) < len(fragments):
                    fragment = fragments[failure.block_index - len(hits)]
                    self._forget(Hit(index=-1, key=fragment.key, tier=fragment.tier), failure.cause, namespace)
                if fragments:
                    # A fragment (or the prefix under it) failed: serve this request with prefix reuse only.
                    fragments = []
                    trace.blend = "no-fragment"
        trace.ttft_s = time.perf_counter() - start
        return cache, logits, hits, fragments, percent, exact_until, chain

    # -- fragments (blend) ----------------------------------------------------------------------
    def _match_fragments(
        self, prompt: list[int], start: int, namespace: str, segments: Sequence[tuple[int, int]] = ()
    ) -> list[Fragment]:
        """Block-sized windows after the prefix run whose content this node or the directory knows,
        chosen without overlap (most blocks, fastest tiers). The last prompt token stays computed.

        The windows where stored blocks most likely start are looked up first: those aligned to
        the request's segments and to the block grid after the prefix. Only the stretches they
        leave uncovered are then scanned at every token offset (a fragment at any position), so a
        prompt made of known passages costs one key per block, not one per token."""
        size = self.layout.block_tokens
        end = len(prompt) - 1
        if end - start < size:
            return []
        likely = {offset for offset in segment_windows(segments, block_tokens=size, limit=end) if offset >= start}
        likely.update(range(start, end - size + 1, size))
        candidates = self._fragment_candidates(prompt, sorted(likely), namespace)
        chosen = choose(candidates, start=start, end=end)
        rest = [
            offset
            for gap_start, gap_end in gaps(chosen, start=start, end=end)
            for offset in range(gap_start, gap_end - size + 1)
            if offset not in likely
        ]
        if rest:
            candidates.update(self._fragment_candidates(prompt, rest, namespace))
            chosen = choose(candidates, start=start, end=end)
        if len(chosen) < self.blend_options.min_fragment_blocks:
            return []
        return chosen

    def _fragment_candidates(self, prompt: list[int], offsets: Sequence[int], namespace: str) -> dict[int, Fragment]:
        """The windows at `offsets` whose content key this node's index or the directory knows."""
        size = self.layout.block_tokens
        fp = self.fingerprinter(namespace)
        keys = content_keys_at(prompt, offsets, ns_salt=fp.ns_salt, model_key=self.model_key, block_tokens=size)
        candidates: dict[int, Fragment] = {}
        known = {offset: self.content_index[key] for offset, key in keys.items() if key in self.content_index}
        if known:
            # Where a directory vouches for L3 copies, the node's own memory of a block cannot: a
            # block only L3 still holds is matched through the directory below, with its checksum.
            tiers = self.offload.local_tiers if self.offload.verifies_remote else None
            located = self.store.locate(list({stored for stored, _ in known.values()}), tiers=tiers)
            for offset, (stored, position) in known.items():
                if located.get(stored):
                    candidates[offset] = Fragment(
                        start=offset, tokens=size, key=stored, source_position=position, tier=located[stored][0]
                    )
        rest = [offset for offset in keys if offset not in candidates]
        if rest and self.directory is not None:
            candidates.update(
                directory_fragments(
                    self.directory,
                    {offset: keys[offset] for offset in rest},
                    node=self.node,
                    namespace=namespace,
                    model_key=self.model_key,
                    tiers=self.store.names,
                    block_tokens=size,
                    counters=self.counters,
                )
            )
        return candidates

    def _blend_prefill(
        self, prompt: list[int], hits: list[Hit], fragments: list[Fragment], percent: float, trace: RequestTrace
    ) -> tuple[StrataCache, torch.Tensor]:
        """Load the prefix and the fragments layer by layer and prefill with selective recompute."""
        size = self.layout.block_tokens
        prefix_len = len(hits) * size
        loads = hits + [Hit(index=-1, key=f.key, tier=f.tier, checksum=f.checksum) for f in fragments]
        buffers = self._prefix_buffers(len(loads))
        loader = self._loader(loads, buffers)
        stalls = [0.0] * self.model.layers
        device = self.model.device
        count = len(hits)

        def source(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            stalls[layer] = loader.gates[layer].wait()
            typed = buffers.typed[layer]  # [blocks, 2, block_tokens, kv_heads, head_dim]
            return typed[:count], typed[count:]

        plan = BlendPlan(
            prefix_len=prefix_len,
            fragments=fragments,
            recompute_ratio=percent / 100.0,
            selection=self.blend_options.selection,
            check_layer=self.blend_options.check_layer,
        )
        try:
            if not trace.layerwise:
                self._wait_loaded(loader, trace)
            started = time.perf_counter()
            outcome = blend_prefill(self.model.model, prompt, plan, source, device=device)
        except LoadFailed:
            loader.cancel()
            loader.join()
            raise
        trace.prefill_s = time.perf_counter() - started
        loader.join()
        self._observe_load(loader)
        fragment_tokens = sum(f.tokens for f in fragments)
        trace.prefix_tokens = prefix_len
        trace.fragment_tokens = fragment_tokens
        trace.recomputed_tokens = outcome.recomputed_tokens
        trace.recompute_ratio = outcome.recomputed_tokens / fragment_tokens if fragment_tokens else 0.0
        trace.cached_tokens = prefix_len + outcome.reused_tokens
        trace.hit_blocks_by_tier = dict(collections.Counter(h.tier for h in hits))
        trace.fragment_blocks_by_tier = dict(collections.Counter(f.tier for f in fragments))
        trace.layer_stall_s = stalls
        trace.layer_loaded_at_s = [t.finished - loader.started_at for t in loader.timings]
        if trace.layerwise:
            trace.load_s = loader.finished_at - loader.started_at
        self.counters.add("hit_tokens", trace.cached_tokens)
        self.counters.add("blend.requests")
        self.counters.add("reused_tokens.prefix", prefix_len)
        self.counters.add("reused_tokens.fragment", fragment_tokens)
        self.counters.add("blend.recomputed_tokens", outcome.recomputed_tokens)
        for name, blocks in trace.hit_blocks_by_tier.items():
            self.counters.add(f"hit_blocks.{name}", blocks)
        for name, blocks in trace.fragment_blocks_by_tier.items():
            self.counters.add(f"fragment_blocks.{name}", blocks)
        return outcome.cache, outcome.logits

    def _prefill(self, prompt: list[int], hits: list[Hit], trace: RequestTrace) -> tuple[StrataCache, torch.Tensor]:
        model = self.model
        # At least the last prompt token is computed: its logits give the first output token.
        prefix_len = min(len(hits) * self.layout.block_tokens, len(prompt) - 1)
        loader = None
        if prefix_len:
            hits = hits[: (prefix_len + self.layout.block_tokens - 1) // self.layout.block_tokens]
            buffers = self._prefix_buffers(len(hits))
            loader = self._loader(hits, buffers)
            cache = StrataCache(
                layers=model.layers,
                prefix_len=prefix_len,
                source=lambda layer: buffers.kv_parts(layer, prefix_len),
                gates=loader.gates,
            )
        else:
            cache = StrataCache(layers=model.layers)
        # With nothing cached, the full blocks are prefilled first and the rest on its own: the rest
        # is then computed exactly as a later request that finds every full block cached computes
        # it (same rows in the same kernels over the same cached bytes), so that hit's output is
        # the cold output bit for bit. In one pass, matrix kernels that block the work by row
        # count (bfloat16 on AMX, for one) round the last rows differently, and on a near tie a
        # greedy token can flip.
        split = (
            0
            if prefix_len
            else min(len(prompt) // self.layout.block_tokens * self.layout.block_tokens, len(prompt) - 1)
        )
        try:
            if loader is not None and not trace.layerwise:
                self._wait_loaded(loader, trace)
            started = time.perf_counter()
            if split:
                head = torch.tensor([prompt[:split]], device=model.device)
                model.model(input_ids=head, past_key_values=cache, use_cache=True, logits_to_keep=1)
            ids = torch.tensor([prompt[max(prefix_len, split) :]], device=model.device)
            out = model.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        except LoadFailed:
            if loader is not None:
                loader.cancel()
                loader.join()
            raise
        prefill_s = time.perf_counter() - started
        trace.prefill_s = prefill_s
        trace.cached_tokens = prefix_len
        trace.prefix_tokens = prefix_len
        self.counters.add("reused_tokens.prefix", prefix_len)
        trace.hit_blocks_by_tier = dict(collections.Counter(h.tier for h in hits))
        self.counters.add("hit_tokens", prefix_len)
        for name, count in trace.hit_blocks_by_tier.items():
            self.counters.add(f"hit_blocks.{name}", count)
        if loader is not None:
            loader.join()
            trace.layer_stall_s = list(cache.stalls)
            trace.layer_loaded_at_s = [t.finished - loader.started_at for t in loader.timings]
            if trace.layerwise:
                trace.load_s = loader.finished_at - loader.started_at
            self._observe_load(loader)
        if not prefix_len:
            self.offload.observe_prefill(len(prompt), prefill_s)
        return cache, out.logits[0, -1]

    def _loader(self, hits: Sequence[Hit], buffers: PrefixBuffers) -> LayerLoader:
        """A started load of `hits` into `buffers`; a copy read from L3 must carry the checksum
        the directory registered for it (`OffloadManager.verifies_remote`)."""
        return LayerLoader(
            store=self.store,
            hits=hits,
            buffers=buffers,
            inline=self._inline_load(hits),
            verify_remote=self.offload.verifies_remote,
            deadline_s=self.options.load_deadline_s,
        ).start()

    def _prefix_buffers(self, blocks: int) -> PrefixBuffers:
        """The buffers a load fills, where the model computes: attention joins them with the new
        tokens' K and V, which must be on the same device."""
        # Normal (not inference-mode) tensors: the tiers' own I/O threads write into them.
        with torch.inference_mode(False):
            return PrefixBuffers(layout=self.layout, blocks=blocks, device=self.model.device)

    @staticmethod
    def _wait_loaded(loader: LayerLoader, trace: RequestTrace) -> None:
        """Load-then-compute: wait for every layer (raises the first LoadFailed)."""
        try:
            loader.wait_all()
        finally:
            trace.load_s = time.perf_counter() - loader.started_at

    def _inline_load(self, hits: Sequence[Hit]) -> bool:
        """Load in the computing thread, layer by layer at each sync point, when every block is in
        the device tier and that lives in CPU memory (a model on the CPU): such reads are
        memory copies, CPU work a loader thread would only take from the model's own threads,
        making layer-wise loading slower than loading first (benchmarks/README.md). On a GPU
        they are copies on
        the tier's stream, and the loader thread overlaps them with compute."""
        return self.model.device.type == "cpu" and all(hit.tier == DEVICE for hit in hits)

    def _observe_load(self, loader: LayerLoader) -> None:
        """Learn each tier's speed from a finished load, one tier or many (see
        `LayerLoader.tier_loads` for how bytes and time are attributed to each)."""
        self.offload.observe_load(loader.tier_loads())

    def _decode(
        self,
        cache: StrataCache,
        logits: torch.Tensor,
        max_tokens: int,
        trace: RequestTrace,
        stop_ids: set[int],
        on_token: Callable[[int], bool] | None,
        sampler: Sampler,
    ) -> list[int]:
        output: list[int] = []
        started = time.perf_counter()
        token = sampler.pick(logits)
        while True:
            output.append(token)
            if on_token is not None and on_token(token):
                trace.finish_reason = "stop"
                break
            if token in stop_ids:
                trace.finish_reason = "stop"
                break
            if len(output) >= max_tokens:
                trace.finish_reason = "length"
                break
            # One turn per token: a waiting prefill of another request runs before the next step.
            with self._turns.hold(Step.DECODE), torch.inference_mode():
                ids = torch.tensor([[token]], device=self.model.device)
                out = self.model.model(input_ids=ids, past_key_values=cache, use_cache=True)
                token = sampler.pick(out.logits[0, -1])
        trace.decode_s = time.perf_counter() - started
        trace.output_tokens = len(output)
        return output

    # -- failed loads -------------------------------------------------------------------------
    def _forget(self, hit: Hit, cause: BaseException, namespace: str) -> None:
        """A hit that could not be loaded. A device copy leaves the working set; a copy that failed
        its checksum (the tier has already dropped its bytes) is quarantined in the directory at
        once, so no node is sent to it again before the reconciler runs."""
        if hit.tier == DEVICE and self.working_set is not None:
            self.working_set.forget(hit.key)
        self.offload.quarantine(hit.key, cause, namespace)
