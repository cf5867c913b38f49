"""Progress bars for long runs (benchmarks, `plot` of a long script): tqdm on stderr.

tqdm comes with the `ops` extra; without it the items are simply yielded (the bar is display
only, it changes nothing the run computes)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str) -> Iterator[T]:
    items = list(items)
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    yield from tqdm(items, desc=desc, file=sys.stderr, leave=False)
