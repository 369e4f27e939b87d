"""The pages a load failed to fill, and the saves they poison: a block is never stored from KV that
was computed over such a page.

When a load fails, its pages hold whatever they held before (another request's KV, or part of
this one's), and vLLM learns of it only from the step's report: the forward pass of that step
has already run over them, and so may later steps planned before the report was read (vLLM's
asynchronous scheduling plans step N+1 before step N ends; pipeline stages keep several in
flight). Every token computed in those steps over a failed page has wrong KV, and so has every
full block whose prefix holds one: block i of a request attends to its pages 0 .. (i + 1) *
pages_per_block - 1.

Three rules make a poisoned store impossible rather than unlikely:

1. Here, on the worker: a save planned before the scheduler half read the report of the step
   whose load failed (`StrataMetadata.reported` below that step) is dropped, and counted
   (`write_back.poisoned`), when its block's prefix pages include a failed page. The worker
   knows a failure in the step it happens, before that step's saves are made, so this holds for
   the failing step itself and for every step already planned when it failed.
2. In the scheduler half: the pages a synchronous load fills are out of vLLM's prefix cache
   until the load is reported whole (`shared_pages`), so no other request can hold a failed
   page: the request that loaded it is the only one computing over it.
3. Once the scheduler half has read the report, vLLM has truncated that request to its first
   failed page and recomputes from there; the scheduler half plans its saves again from that
   block (`SchedulerHalf.update`), now over recomputed pages.

A failed page is forgotten once a plan made after the report arrives (`acknowledged`): past
then, rule 3 holds for the request that had it, and a page freed and handed to another request
is that request's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class FailedPages:
    """The pages loads failed to fill, by the step in which they failed, until a plan made after
    the scheduler half read that step's report."""

    def __init__(self, *, pages_per_block: int) -> None:
        if pages_per_block <= 0:
            raise ValueError(f"pages_per_block must be positive, got {pages_per_block}")
        self.pages_per_block = pages_per_block
        self._by_step: dict[int, set[int]] = {}
        self._pages: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self._pages)

    @property
    def pages(self) -> frozenset[int]:
        return self._pages

    def failed(self, step: int, pages: Iterable[int]) -> None:
        """Loads of step `step` failed to fill `pages`."""
        pages = set(pages)
        if pages:
            self._by_step.setdefault(step, set()).update(pages)
            self._pages = self._pages | pages

    def acknowledged(self, reported: int) -> None:
        """A plan made after the scheduler half read the reports of steps up to `reported`: their
        failures are known to it (and to vLLM), and forgotten here."""
        known = [step for step in self._by_step if step <= reported]
        if known:
            for step in known:
                del self._by_step[step]
            self._pages = frozenset().union(*self._by_step.values()) if self._by_step else frozenset()

    def poisons(self, pages: Sequence[int], index: int) -> bool:
        """Whether block `index` of a request whose page table is `pages` was computed over a
        failed page (one of its prefix pages failed)."""
        if not self._pages:
            return False
        return not self._pages.isdisjoint(pages[: (index + 1) * self.pages_per_block])
