"""Cache-aware generation: fingerprint -> lookup -> layer-wise load -> prefill the rest -> decode -> write back."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import torch

from worker.dataplane.counters import Counters
from worker.dataplane.directory import (
    BlockRegistration,
    BlockTouch,
    Directory,
    DirectoryUnavailable,
)
from worker.dataplane.engine.cache import LoadFailed, StrataCache
from worker.dataplane.engine.loader import Hit, LayerLoader, PrefixBuffers
from worker.dataplane.engine.models import LoadedModel
from worker.dataplane.errors import MISSES, TierFull
from worker.dataplane.hashing import BlockFingerprint, Fingerprinter, model_key
from worker.dataplane.layout import ModelProfile
from worker.dataplane.store import TieredStore
from worker.dataplane.tiers.base import TIER_NAMES

log = logging.getLogger("strata.engine")


@dataclasses.dataclass
class RequestTrace:
    """What happened to one request: where each block came from and where time went."""

    request_id: str
    namespace: str
    prompt_tokens: int
    cached_tokens: int = 0
    hit_blocks_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    decision: str = "no-hit"
    layerwise: bool = True
    load_failures: int = 0
    lookup_s: float = 0.0
    ttft_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    output_tokens: int = 0
    finish_reason: str = "length"
    layer_stall_s: list[float] = dataclasses.field(default_factory=list)
    layer_loaded_at_s: list[float] = dataclasses.field(default_factory=list)
    written_blocks: int = 0
    started_at: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerationResult:
    output_ids: list[int]
    trace: RequestTrace
    first_logits: torch.Tensor
    """Logits of the last prompt position (what chose the first output token)."""


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
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class Throughput:
    """An exponentially weighted estimate of a rate (bytes/s of a tier, tokens/s of prefill)."""

    def __init__(self, initial: float | None = None, weight: float = 0.3) -> None:
        self.value = initial
        self.weight = weight

    def observe(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value is None else (1 - self.weight) * self.value + self.weight * rate


@dataclasses.dataclass
class EngineOptions:
    block_tokens: int = 256
    layerwise: bool = True
    write_back_tier: str = "host"
    keep_in_device: bool = True
    """Keep new and reused blocks in the device pool (LRU within its capacity)."""
    decide: bool = True
    """Choose per request between loading hits and recomputing them, from measured speeds."""


class Engine:
    """One model on one node, its tiers, and (optionally) the directory shared by all nodes.

    Requests run one at a time (a queue): concurrent callers never see each other's state."""

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
    ) -> None:
        self.model = model
        self.store = store
        self.node = node
        self.directory = directory
        self.options = options or EngineOptions()
        if namespace_salt is None:
            namespace_salt = directory.namespace_salt if directory is not None else (lambda name: name.encode())
        self.namespace_salt = namespace_salt
        self.counters = counters or Counters()
        self.on_trace = on_trace
        self.profile = ModelProfile(
            model_id=model.name, layers=model.layers, kv_heads=model.kv_heads, head_dim=model.head_dim,
            dtype=str(model.dtype).removeprefix("torch."), block_tokens=self.options.block_tokens,
            revision=model.revision, rope_theta=model.rope_theta,
        )
        self.layout = self.profile.layout
        if store.layout != self.layout:
            raise ValueError(f"the store holds blocks of {store.layout.describe()}, the model needs {self.layout.describe()}")
        if self.options.write_back_tier not in store.names:
            raise ValueError(f"write_back_tier: the store has no tier {self.options.write_back_tier!r}")
        self.model_key = model_key(self.profile)
        self._fingerprinters: dict[str, Fingerprinter] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._device_lru: collections.OrderedDict[uuid.UUID, None] = collections.OrderedDict()
        self.tier_speed = {name: Throughput() for name in TIER_NAMES}
        self.prefill_speed = Throughput()
        self.traces: collections.deque[RequestTrace] = collections.deque(maxlen=200)

    # -- public -------------------------------------------------------------------------------
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
    ) -> GenerationResult:
        """Generate up to `max_tokens` tokens after `prompt_ids`: greedy at temperature 0, else
        sampled (reproducibly with `seed`). `on_token` sees each token and returns True to stop."""
        if not prompt_ids:
            raise ValueError("prompt: at least one token is needed")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1, got {max_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature: cannot be negative, got {temperature}")
        if len(prompt_ids) + max_tokens > self.model.max_context:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens + max_tokens {max_tokens} exceed the model's context of "
                f"{self.model.max_context}"
            )
        with self._lock, torch.inference_mode():
            trace = RequestTrace(request_id=f"req-{next(self._ids)}", namespace=namespace,
                                 prompt_tokens=len(prompt_ids), started_at=time.time(),
                                 layerwise=self.options.layerwise if layerwise is None else layerwise)
            sampler = Sampler(temperature=temperature, seed=seed)
            output, logits = self._generate(list(prompt_ids), max_tokens, namespace, use_cache, trace,
                                            set(stop_ids), on_token, sampler)
            self.traces.append(trace)
            if self.on_trace is not None:
                self.on_trace(trace)
            return GenerationResult(output_ids=output, trace=trace, first_logits=logits.float().cpu())

    def fingerprinter(self, namespace: str) -> Fingerprinter:
        if namespace not in self._fingerprinters:
            self._fingerprinters[namespace] = Fingerprinter(
                ns_salt=self.namespace_salt(namespace), model_key=self.model_key, block_tokens=self.layout.block_tokens
            )
        return self._fingerprinters[namespace]

    # -- the request path ---------------------------------------------------------------------
    def _generate(self, prompt: list[int], max_tokens: int, namespace: str, use_cache: bool, trace: RequestTrace,
                  stop_ids: set[int], on_token: Callable[[int], bool] | None, sampler: Sampler
                  ) -> tuple[list[int], torch.Tensor]:
        start = time.perf_counter()
        fingerprints: list[BlockFingerprint] = []
        if use_cache:
            try:
                fingerprints = self.fingerprinter(namespace).blocks(prompt)
            except DirectoryUnavailable as exc:
                # Without the namespace's salt nothing can be matched or stored: serve uncached.
                log.warning("request %s runs without the cache: %s", trace.request_id, exc)
                self.counters.add("lookup_failures")
                use_cache = False
        hits = self._lookup(fingerprints, namespace) if fingerprints else []
        trace.lookup_s = time.perf_counter() - start
        self.counters.add("lookup_tokens", len(prompt))
        hits = self._decide(hits, len(prompt), trace)
        while True:
            try:
                cache, logits = self._prefill(prompt, hits, trace)
                break
            except LoadFailed as failure:
                # A vanished or corrupt block is a miss: recompute from it, never serve it.
                trace.load_failures += 1
                self.counters.add("load_failures")
                self._forget(hits[failure.block_index])
                hits = hits[: failure.block_index]
        trace.ttft_s = time.perf_counter() - start
        output = self._decode(cache, logits, max_tokens, trace, stop_ids, on_token, sampler)
        if use_cache:
            self._write_back(prompt + output[:-1], hits, cache, namespace, trace)
        return output, logits

    def _lookup(self, fingerprints: Sequence[BlockFingerprint], namespace: str) -> list[Hit]:
        """The longest run of prompt blocks held somewhere: the node's own tiers first (in memory
        and local files), then one directory round trip (or the remote tier itself) for the rest."""
        keys = [fp.prefix_key for fp in fingerprints]
        local = [name for name in self.store.names if name != "remote"]
        found: dict[uuid.UUID, str] = {
            key: names[0] for key, names in self.store.locate(keys, tiers=local).items() if names
        }
        # Only blocks before the first local miss can extend the prefix run.
        first_miss = next((i for i, key in enumerate(keys) if key not in found), len(keys))
        missing = keys[first_miss:]
        if missing and "remote" in self.store.names:
            try:
                if self.directory is not None:
                    located = self.directory.lookup(keys=missing, node=self.node, namespace=namespace,
                                                    model_key=self.model_key)
                    for key, tier_name in located.items():
                        if tier_name == "remote":
                            found[key] = tier_name
                else:
                    for key, present in zip(missing, self.store.tier("remote").contains_many(missing), strict=True):
                        if present:
                            found[key] = "remote"
            except Exception as exc:  # noqa: BLE001 - an outage of the directory or L3 means recompute
                log.warning("remote lookup failed, treating as a miss: %s", exc)
                self.counters.add("lookup_failures")
        hits = []
        for fp in fingerprints:
            tier = found.get(fp.prefix_key)
            if tier is None:
                break  # chained keys: nothing after a missing block can be a prefix hit
            hits.append(Hit(index=fp.index, key=fp.prefix_key, tier=tier))
        return hits

    def _decide(self, hits: list[Hit], prompt_tokens: int, trace: RequestTrace) -> list[Hit]:
        """Load the hits or recompute them, whichever the measured speeds say is faster."""
        if not hits:
            trace.decision = "no-hit"
            self.counters.add("decision.no_hit")
            return hits
        if not self.options.decide:
            trace.decision = "load"
            self.counters.add("decision.load")
            return hits
        tokens = len(hits) * self.layout.block_tokens
        load_s = 0.0
        unknown = False
        for name in {h.tier for h in hits}:
            speed = self.tier_speed[name].value
            count = sum(1 for h in hits if h.tier == name)
            if speed is None:
                unknown = True
            else:
                load_s += count * self.layout.block_bytes / speed
        compute = self.prefill_speed.value
        if unknown or compute is None or load_s <= tokens / compute:
            trace.decision = "load"
            self.counters.add("decision.load")
            return hits
        trace.decision = "recompute"
        self.counters.add("decision.recompute")
        log.info("request %s: recomputing %d cached tokens (load %.3fs > compute %.3fs)",
                 trace.request_id, tokens, load_s, tokens / compute)
        return []

    def _prefill(self, prompt: list[int], hits: list[Hit], trace: RequestTrace) -> tuple[StrataCache, torch.Tensor]:
        model = self.model
        # At least the last prompt token is computed: its logits give the first output token.
        prefix_len = min(len(hits) * self.layout.block_tokens, len(prompt) - 1)
        loader = None
        if prefix_len:
            hits = hits[: (prefix_len + self.layout.block_tokens - 1) // self.layout.block_tokens]
            # Normal (not inference-mode) tensors: the tiers' own I/O threads write into them.
            with torch.inference_mode(False):
                buffers = PrefixBuffers(layout=self.layout, blocks=len(hits), device=torch.device("cpu"))
            loader = LayerLoader(store=self.store, hits=hits, buffers=buffers).start()
            cache = StrataCache(layers=model.layers, prefix_len=prefix_len,
                                source=lambda layer: buffers.kv_parts(layer, prefix_len), gates=loader.gates)
            if not trace.layerwise:
                try:
                    loader.wait_all()
                finally:
                    trace.load_s = time.perf_counter() - loader.started_at
        else:
            cache = StrataCache(layers=model.layers)
        started = time.perf_counter()
        ids = torch.tensor([prompt[prefix_len:]], device=model.device)
        try:
            out = model.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        except LoadFailed:
            if loader is not None:
                loader.cancel()
                loader.join()
            raise
        prefill_s = time.perf_counter() - started
        trace.prefill_s = prefill_s
        trace.cached_tokens = prefix_len
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
            self._observe_load(hits, loader)
        if not prefix_len:
            self.prefill_speed.observe(len(prompt), prefill_s)
        return cache, out.logits[0, -1]

    def _observe_load(self, hits: list[Hit], loader: LayerLoader) -> None:
        if not loader.timings:
            return
        seconds = sum(t.finished - t.started for t in loader.timings)
        tiers = {h.tier for h in hits}
        if len(tiers) == 1:
            (name,) = tiers
            self.tier_speed[name].observe(sum(t.bytes for t in loader.timings), seconds)

    def _decode(self, cache: StrataCache, logits: torch.Tensor, max_tokens: int, trace: RequestTrace,
                stop_ids: set[int], on_token: Callable[[int], bool] | None, sampler: Sampler) -> list[int]:
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
            ids = torch.tensor([[token]], device=self.model.device)
            out = self.model.model(input_ids=ids, cache=cache, use_cache=True)
            token = sampler.pick(out.logits[0, -1])
        trace.decode_s = time.perf_counter() - started
        trace.output_tokens = len(output)
        return output

    # -- write-back ---------------------------------------------------------------------------
    def _write_back(self, tokens: list[int], hits: list[Hit], cache: StrataCache, namespace: str, trace: RequestTrace) -> None:
        """Copy full new blocks to the write-back tier (and the device pool) and register them in one batch."""
        fingerprints = self.fingerprinter(namespace).blocks(tokens)
        if not fingerprints:
            return
        hit_tiers = {h.key: h.tier for h in hits}
        target = self.store.tier(self.options.write_back_tier)
        registrations: list[BlockRegistration] = []
        with torch.inference_mode(False):
            block = self.layout.empty()
        views = self.layout.kv_views(block)
        size = self.layout.block_tokens
        for fp in fingerprints:
            already = hit_tiers.get(fp.prefix_key)
            if already == "device":
                self._device_touch(fp.prefix_key)
                continue
            to_target = already is None and not target.contains(fp.prefix_key)
            to_device = self.options.keep_in_device and target.name != "device" and "device" in self.store.names
            if not to_target and not to_device:
                continue
            for layer, (k_dst, v_dst) in enumerate(views):
                keys, values = cache.layer_kv(layer)
                k_dst.copy_(keys[0, :, fp.start : fp.start + size].transpose(0, 1))
                v_dst.copy_(values[0, :, fp.start : fp.start + size].transpose(0, 1))
            if to_device:
                self._device_put(fp.prefix_key, block)
            if not to_target:
                continue
            if target.name == "device":
                # L1 is the node's working set, not registered in the directory: LRU within capacity.
                if self._device_put(fp.prefix_key, block):
                    trace.written_blocks += 1
                continue
            try:
                result = target.put(fp.prefix_key, block)
            except TierFull as exc:
                self.counters.add(f"write_back.{target.name}.full")
                log.warning("write-back skipped: %s", exc)
                continue
            except MISSES as exc:
                self.counters.add(f"write_back.{target.name}.failed")
                log.warning("write-back failed: %s", exc)
                continue
            trace.written_blocks += 1
            registrations.append(BlockRegistration(
                namespace=namespace, model_key=self.model_key, prefix_key=fp.prefix_key,
                content_key=fp.content_key, position=fp.start, tokens=size, tier=target.name,
                node=None if target.name == "remote" else self.node, nbytes=self.layout.block_bytes,
                checksum=result.checksum.hex if result.checksum else "",
            ))
        if self.directory is not None:
            if registrations:
                self.directory.register(blocks=registrations)
            if hits:
                self.directory.touch(touches=[BlockTouch(namespace=namespace, model_key=self.model_key,
                                                         prefix_key=h.key) for h in hits])

    def _device_put(self, key: uuid.UUID, block: torch.Tensor) -> bool:
        """Keep a copy in the device pool, evicting its least recently used blocks to make room."""
        device = self.store.tier("device")
        if device.contains(key):
            self._device_touch(key)
            return False
        while True:
            try:
                device.put(key, block)
                self._device_lru[key] = None
                return True
            except TierFull:
                if not self._device_lru:
                    return False
                victim, _ = self._device_lru.popitem(last=False)
                device.delete(victim)
                self.counters.add("device.evicted")

    def _device_touch(self, key: uuid.UUID) -> None:
        if key in self._device_lru:
            self._device_lru.move_to_end(key)

    def _forget(self, hit: Hit) -> None:
        if hit.tier == "device":
            self._device_lru.pop(hit.key, None)
