"""vLLM's prefix cache and the pages of a synchronous load: out of it while the load may fail, back in
once it is known to have loaded.

vLLM enters a request's pages in its prefix cache as it allocates them, before a synchronous
load has filled them. Were the load to fail, the pages would hold another request's KV, and a
request vLLM schedules meanwhile with the same prefix would be handed them as a local hit and
compute over them; vLLM recomputes the failing request from its first failed page, but not one
that shares the page and is then left alone (the owner aborted or preempted). So the pages the
load fills, and the request's later ones, leave the prefix cache at once (`unshare`), and go
back into it (`reshare`) when the worker reports the load whole: from then on they hold exactly
what vLLM alone would have computed, and later requests hit them as they would have.

This is the one place the connector reaches into vLLM's block pool: `KVCacheManager.evict_blocks`
(vLLM's own call for failed loads), `get_blocks`, and `BlockPool.cache_full_blocks` (what vLLM's
own caching calls), for the first KV cache group (the connector serves one group only). An error
there leaves the pages out of the prefix cache: a local hit lost, never a wrong one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

log = logging.getLogger("strata.vllm")


class LoadedPages:
    """Takes a synchronous load's pages out of vLLM's prefix cache, and puts them back."""

    def __init__(self, kv_cache_manager: KVCacheManager, *, page_tokens: int) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.page_tokens = page_tokens
        self._failing = ""

    def unshare(self, pages: Sequence[int], first: int) -> None:
        """Take `pages[first:]` (the load's and the request's later pages) out of the prefix cache."""
        unshared = set(pages[first:])
        if unshared:
            self.kv_cache_manager.evict_blocks(unshared)

    def reshare(self, request: Request, pages: Sequence[int], first: int) -> int:
        """Put back the request's full pages from `first` on that `unshare` took out, now that its
        load is reported whole; how many (0 while the request no longer runs on the same pages
        (preempted, ended): those pages may be another request's by now)."""
        try:
            if request.status != RequestStatus.RUNNING:
                return 0
            blocks = list(self.kv_cache_manager.get_blocks(request.request_id).blocks[0])
            if [block.block_id for block in blocks[: len(pages)]] != list(pages):
                return 0
            full = min(request.num_computed_tokens, request.num_tokens, len(blocks) * self.page_tokens)
            end = first
            # The run vLLM entered and `unshare` took out; pages past it vLLM has entered since.
            while end < full // self.page_tokens and blocks[end].block_hash is None:
                end += 1
            if end > first:
                self.kv_cache_manager.block_pool.cache_full_blocks(request, blocks, first, end, self.page_tokens, 0)
            return end - first
        except Exception as exc:  # noqa: BLE001 - the pages stay out of the prefix cache: a lost hit only
            kind = type(exc).__name__
            if kind != self._failing:
                log.warning(
                    "StrataConnector: a loaded request's pages could not go back into vLLM's prefix cache: %s", exc
                )
            self._failing = kind
            return 0
