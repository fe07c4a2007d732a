"""Threads for the codec's per-chunk work: the compiled loops (and torch's kernels) release the GIL.

`threads` everywhere in the codec: None takes every core this process may run on; 1 runs in the caller's
thread. Results never depend on it: work is split into fixed spans, and results are put back in order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")
SPAN = 1 << 22  # elements per unit of work where the split is free to choose (change detection)


def default_threads() -> int:
    """The cores this process may run on (its affinity mask), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@cache
def _executor(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix=f"deltasync-codec-{threads}")


def parallel_map(fn: Callable[[T], R], items: Iterable[T], threads: int | None = None) -> list[R]:
    """[fn(item) for item in items], on up to `threads` threads. Never nest it (a task waiting on tasks of the
    same pool can wait forever)."""
    items = list(items)
    threads = threads or default_threads()
    if threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    return list(_executor(threads).map(fn, items))


def spans(numel: int, span: int = SPAN) -> list[tuple[int, int]]:
    """[start, end) of consecutive pieces of at most `span` elements covering `numel` (at least one)."""
    return [(lo, min(lo + span, numel)) for lo in range(0, max(numel, 1), span)]
