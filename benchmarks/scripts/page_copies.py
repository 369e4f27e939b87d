"""The copies between vLLM's CPU attention pages and Strata's blocks, natively and by torch.

    python -m benchmarks.scripts.page_copies [--runs 3]

On the `vllm` suite's bench model geometry (8 layers, 4 kv heads, head_dim 64, bfloat16,
128-token pages, 256-token blocks): 40 blocks (80 MiB) scattered into 80 pages (a load, ending
inside a page) and gathered back (saves), for each CPU layout, with `PagedKV`'s native copy on
and off, beside a memcpy of the same bytes; the median of five scatters and three gathers, torch
at one thread. Every byte the two copies leave is compared, and a difference exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from worker.dataplane.connectors.pages import PagedKV
from worker.dataplane.layout import BlockLayout

LAYERS, HEADS, DIM, PAGE, BLOCK, BLOCKS = 8, 4, 64, 128, 256, 40


def median_seconds(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_run() -> bool:
    layout = BlockLayout(LAYERS, HEADS, DIM, BLOCK, torch.bfloat16)
    blocks = torch.randn(LAYERS, BLOCKS, 2, BLOCK, HEADS, DIM).to(torch.bfloat16)
    pages = list(range(BLOCKS * BLOCK // PAGE))
    gib = blocks.numel() * blocks.element_size() / 2**30
    same = True
    for kind in ("cpu-vec", "cpu-amx"):
        left = []
        for native_copy in (False, True):
            layers = [torch.zeros(len(pages) + 16, HEADS, PAGE, 2 * DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
            paged = PagedKV(layers, kind=kind, layout=layout, native_copy=native_copy)
            saved = torch.zeros(BLOCKS, layout.block_bytes, dtype=torch.uint8)

            def scatter(paged: PagedKV = paged) -> None:
                for layer in range(LAYERS):
                    end = BLOCKS * BLOCK - 37
                    paged.scatter(layer, blocks[layer], first_block=0, start=0, end=end, pages=pages)

            def gather(paged: PagedKV = paged, saved: torch.Tensor = saved) -> None:
                for index in range(BLOCKS):
                    paged.gather(saved[index], index=index, pages=pages)

            loads, saves = gib / median_seconds(scatter, 5), gib / median_seconds(gather, 3)
            name = "native" if native_copy else "torch"
            print(f"{kind:8} {name:6}  scatter {loads:5.2f} GiB/s  gather {saves:5.2f} GiB/s")
            left.append((layers, saved))
        (torch_layers, torch_saved), (native_layers, native_saved) = left
        equal = all(torch.equal(a, b) for a, b in zip(torch_layers, native_layers, strict=True))
        equal = equal and torch.equal(torch_saved, native_saved)
        print(f"{kind:8} every byte the same: {equal}")
        same = same and equal
    source, target = blocks.clone(), torch.empty_like(blocks)
    print(f"memcpy of the same bytes: {gib / median_seconds(lambda: target.copy_(source), 5):.2f} GiB/s")
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="times to measure everything (default 3)")
    runs = parser.parse_args().runs
    if runs < 1:
        parser.error(f"--runs: at least 1, got {runs}")
    torch.set_num_threads(1)
    same = True
    for run in range(runs):
        print(f"run {run + 1} of {runs}")
        same = one_run() and same
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
