"""A closed loop of requests: N in flight, each worker sending the next as soon as its own has ended."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def closed_loop(records: list, concurrency: int, one: Callable[[int], Awaitable[dict]],
                      on_done: Callable[[], None] | None = None) -> None:
    """records[i] = await one(i) for every index of `records` (its slots None until then), `concurrency` at a
    time, in index order; `on_done()` after each."""
    next_index = 0

    async def worker():
        nonlocal next_index
        while next_index < len(records):
            i = next_index
            next_index += 1
            records[i] = await one(i)
            if on_done is not None:
                on_done()

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
