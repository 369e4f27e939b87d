"""Fragment reuse on a vLLM node, the scheduler half's part: which stored blocks recur in a prompt
after its exact prefix (by content key, at any token offset), and where the load that assembles
them ends.

The blocks are found through the content keys of the blocks this node's saves stored
(`ContentIndex`, filled as the saves are planned; a block none of its own tiers holds any more is
not offered from there), then, where the node has a directory, through the directory's content
index (blocks other nodes stored, and copies only L3 still holds, each with the checksum a copy
read from L3 must carry). The windows where stored blocks most likely start go first (the block
grid after the prefix), then every other offset of the stretches they leave uncovered, as the
engine matches (`engine.Engine._match_fragments`). Where a directory is asked, the search runs on
a thread of its own and the scheduler asks again next step (`for_request` answers WAIT), so
vLLM's scheduler loop never waits on the database; an answer later than `lookup_deadline_seconds`
is given up (the request reuses its prefix only, counted in `blend.lookup_deadlines`).

The load ends one token past the last fragment: that token is computed by the selective recompute
(`blend_prefill` computes a prompt's last token), and vLLM computes the rest of the prompt over
the assembled pages.

A blended request's pages from its load on are approximate: they stay out of vLLM's prefix cache
(`shared_pages`; the first of them is never put back, so no later one can be reached) and its
blocks from the exact prefix on are never saved.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from worker.dataplane.blend.matching import (
    ContentIndex,
    Fragment,
    choose,
    content_keys_at,
    directory_fragments,
    gaps,
)
from worker.dataplane.blend.options import BlendOptions
from worker.dataplane.blend.tuner import PREFIX_ONLY, BlendTuner
from worker.dataplane.connectors.vllm.lookups import Blend, Tracked
from worker.dataplane.connectors.vllm.metadata import BlendSpec, LoadSpec
from worker.dataplane.hashing import BlockFingerprint
from worker.dataplane.offload import OffloadManager

log = logging.getLogger("strata.vllm")

WAIT = "wait"
"""`for_request`'s answer while a request's fragments are being looked for: ask again next step."""


class FragmentFinder:
    """Finds the fragments of a prompt among the blocks this node stored."""

    def __init__(
        self,
        manager: OffloadManager,
        options: BlendOptions,
        tuner: BlendTuner,
        *,
        model: str,
        deadline_s: float = 2.0,
        entries: int = 1 << 20,
    ) -> None:
        self.manager = manager
        self.deadline_s = deadline_s
        """How long a request waits for its fragment search (`lookup_deadline_seconds`)."""
        self.threads = ThreadPoolExecutor(1, thread_name_prefix="strata-fragments") if manager.directory else None
        self.options = options
        self.tuner = tuner
        """Each namespace's r and mode (blend, or prefix reuse after a fallback), moved by the
        quality samples the worker judges (`blend_checks`) and by operators."""
        self.model = model
        self.block_tokens = manager.layout.block_tokens
        self.index = ContentIndex(entries)

    def remember(self, blocks: Sequence[BlockFingerprint]) -> None:
        """Blocks a save was planned for: their content keys find them from now on."""
        for fp in blocks:
            self.index.remember(fp.content_key, fp.prefix_key, fp.index * self.block_tokens)

    def blend(self, tokens: Sequence[int], namespace: str, *, exact: int) -> Blend | None:
        """The blended load of a prompt whose first `exact` tokens vLLM has or Strata loads exactly,
        or None (no fragment, or fewer than `min_fragment_blocks`, or r is 100, or the namespace fell
        back to prefix reuse)."""
        mode, percent = self.tuner.current(namespace)
        if mode == PREFIX_ONLY:
            return None
        size = self.block_tokens
        # Fragments end before the prompt's last two tokens: one past them is computed by the
        # selective recompute, the last by vLLM (whose logits sample the answer).
        end = len(tokens) - 2
        if percent >= 100 or end - exact < size:
            return None
        likely = list(range(exact, end - size + 1, size))
        candidates = self._candidates(tokens, likely, namespace)
        chosen = choose(candidates, start=exact, end=end)
        rest = [
            offset
            for gap_start, gap_end in gaps(chosen, start=exact, end=end)
            for offset in range(gap_start, gap_end - size + 1)
            if offset not in candidates and (offset - exact) % size
        ]
        if rest:
            candidates.update(self._candidates(tokens, rest, namespace))
            chosen = choose(candidates, start=exact, end=end)
        if not chosen or len(chosen) < self.options.min_fragment_blocks:
            return None
        return Blend(prefix_len=exact // size * size, fragments=chosen, end=chosen[-1].end + 1, percent=percent)

    def for_request(self, tracked: Tracked, *, exact: int) -> Blend | str | None:
        """A request's blended load, looked for once per plan: fragments after its exact prefix
        (`exact` tokens), where the request has no adapter or cache salt (their blocks are keyed
        apart); WAIT while the search runs on its thread."""
        if tracked.scope or tracked.namespace is None:
            return None
        if tracked.blend_checked:
            return tracked.blend
        request_id = tracked.request.request_id
        if self.threads is None:
            tracked.blend_checked = True
            tracked.blend = self._search(tracked, exact)
            return tracked.blend
        if tracked.blend_search is None:
            tracked.blend_search = self.threads.submit(self._search, tracked, exact)
            tracked.blend_search_since = time.perf_counter()
        search = tracked.blend_search
        if not search.done():
            if time.perf_counter() - tracked.blend_search_since < self.deadline_s:
                return WAIT
            log.warning("request %s: no fragment search answer within %g s; prefix reuse only", request_id,
                        self.deadline_s)  # fmt: skip
            self.manager.counters.add("blend.lookup_deadlines")
            search.cancel()
            found = None
        else:
            found = search.result()
        tracked.blend_search, tracked.blend_checked = None, True
        # vLLM's own prefix cache may have grown past the search's exact prefix meanwhile: its
        # pages are exact, a blend would recompute over them; prefix reuse serves such a request.
        tracked.blend = (
            found if found is not None and found.prefix_len >= exact // self.block_tokens * self.block_tokens else None
        )
        return tracked.blend

    def _search(self, tracked: Tracked, exact: int) -> Blend | None:
        assert tracked.namespace is not None
        try:
            return self.blend(list(tracked.request.prompt_token_ids or []), tracked.namespace, exact=exact)
        except Exception:  # noqa: BLE001 - no fragment is a prefix hit only, never an engine error
            log.exception("request %s: fragments not looked for", tracked.request.request_id)
            return None

    def close(self) -> None:
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)

    def load(self, tracked: Tracked, start: int, end: int) -> LoadSpec:
        """The blended load of tokens [start, end) vLLM was promised: the prefix blocks vLLM's pages
        do not hold (Strata's hits), the fragments, r; no block from the exact prefix on is saved."""
        blend, plan, namespace, size = tracked.blend, tracked.plan, tracked.namespace, self.block_tokens
        assert blend is not None and plan is not None and namespace is not None
        if end != blend.end:
            raise RuntimeError(f"a blended load ends at {blend.end}, vLLM counts {end}")
        prefix: dict[int, tuple[uuid.UUID, str, str]] = {}
        for index in range(start // size, blend.prefix_len // size):
            if index >= len(plan.hits):
                raise RuntimeError(f"prefix block {index} is neither in vLLM's pages nor held by Strata")
            hit = plan.hits[index]
            prefix[index] = (hit.key, hit.tier, hit.checksum)
        tracked.saves_until = blend.prefix_len // size
        tracked.load = LoadSpec(
            request_id=tracked.request.request_id,
            namespace=namespace,
            keys=[],
            tiers=[],
            checksums=[],
            first_block=start // size,
            start=start,
            end=end,
            pages=list(tracked.pages),
            blend=BlendSpec(
                tokens=list(tracked.request.prompt_token_ids or [])[:end],
                prefix_len=blend.prefix_len,
                prefix=prefix,
                fragments=list(blend.fragments),
                percent=blend.percent,
                selection=self.options.selection,
                check_layer=self.options.check_layer,
                sample_tokens=list(tracked.request.prompt_token_ids or []) if self.tuner.sampled() else None,
            ),
        )
        trace = tracked.trace
        trace.prefix_tokens = blend.prefix_len
        trace.fragment_tokens = sum(f.tokens for f in blend.fragments)
        trace.fragment_blocks_by_tier = dict(collections.Counter(f.tier for f in blend.fragments))
        trace.blend = "blend"
        trace.blend_percent = blend.percent
        return tracked.load

    def _candidates(self, tokens: Sequence[int], offsets: Sequence[int], namespace: str) -> dict[int, Fragment]:
        size = self.block_tokens
        fingerprinter = self.manager.fingerprinter(namespace)
        keys = content_keys_at(
            tokens, offsets, ns_salt=fingerprinter.ns_salt, model_key=fingerprinter.model_key, block_tokens=size
        )
        # The search may run on the finder's thread while the scheduler's saves remember blocks.
        known = {offset: found for offset, key in keys.items() if (found := self.index.get(key)) is not None}
        located = self.manager.locate_local(list({stored for stored, _ in known.values()})) if known else {}
        candidates = {
            offset: Fragment(start=offset, tokens=size, key=stored, source_position=position, tier=located[stored])
            for offset, (stored, position) in known.items()
            if stored in located
        }
        rest = [offset for offset in keys if offset not in candidates]
        if rest and self.manager.directory is not None:
            candidates.update(
                directory_fragments(
                    self.manager.directory,
                    {offset: keys[offset] for offset in rest},
                    node=self.manager.node,
                    namespace=namespace,
                    model_key=fingerprinter.model_key,
                    tiers=self.manager.store.names,
                    block_tokens=size,
                    counters=self.manager.counters,
                )
            )
        return candidates
