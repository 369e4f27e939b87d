"""Fragment reuse on a vLLM node, the scheduler half's part: which stored blocks recur in a prompt
after its exact prefix (by content key, at any token offset), and where the load that assembles
them ends.

The blocks are found through the content keys of the blocks this node's saves stored
(`ContentIndex`, filled as the saves are planned; a block no tier holds any more is not offered),
the windows where stored blocks most likely start first (the block grid after the prefix), then
every other offset of the stretches they leave uncovered, as the engine matches
(`engine.Engine._match_fragments`). The load ends one token past the last fragment: that token
is computed by the selective recompute (`blend_prefill` computes a prompt's last token), and vLLM
computes the rest of the prompt over the assembled pages.

A blended request's pages from its load on are approximate: they stay out of vLLM's prefix cache
(`shared_pages`; the first of them is never put back, so no later one can be reached) and its
blocks from the exact prefix on are never saved.
"""

from __future__ import annotations

import collections
import logging
import uuid
from collections.abc import Sequence

from worker.dataplane.blend.matching import ContentIndex, Fragment, choose, content_keys_at, gaps
from worker.dataplane.blend.options import BlendOptions
from worker.dataplane.blend.tuner import PREFIX_ONLY, BlendTuner
from worker.dataplane.connectors.vllm.lookups import Blend, Tracked
from worker.dataplane.connectors.vllm.metadata import BlendSpec, LoadSpec
from worker.dataplane.hashing import BlockFingerprint
from worker.dataplane.offload import OffloadManager

log = logging.getLogger("strata.vllm")


class FragmentFinder:
    """Finds the fragments of a prompt among the blocks this node stored."""

    def __init__(
        self, manager: OffloadManager, options: BlendOptions, tuner: BlendTuner, *, model: str, entries: int = 1 << 20
    ) -> None:
        self.manager = manager
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

    def for_request(self, tracked: Tracked, *, exact: int) -> Blend | None:
        """A request's blended load, looked for once per plan: fragments after its exact prefix
        (`exact` tokens), where the request has no adapter or cache salt (their blocks are keyed
        apart)."""
        if tracked.scope or tracked.namespace is None:
            return None
        if not tracked.blend_checked:
            tracked.blend_checked = True
            try:
                tracked.blend = self.blend(list(tracked.request.prompt_token_ids or []), tracked.namespace, exact=exact)
            except Exception:  # noqa: BLE001 - no fragment is a prefix hit only, never an engine error
                log.exception("request %s: fragments not looked for", tracked.request.request_id)
                tracked.blend = None
        return tracked.blend

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
        known = {offset: self.index[key] for offset, key in keys.items() if key in self.index}
        if not known:
            return {}
        located = self.manager.locate_local(list({stored for stored, _ in known.values()}))
        return {
            offset: Fragment(start=offset, tokens=size, key=stored, source_position=position, tier=located[stored])
            for offset, (stored, position) in known.items()
            if stored in located
        }
