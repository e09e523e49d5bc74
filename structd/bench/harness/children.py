"""One forked process per item (a schema), killed at a deadline: what a benchmark over many schemas runs on.

A schema whose compile or walk never ends, or that crashes the grammar
library, costs its own process and its deadline, not the run. Children are
forked, so what the parent loaded first (the tokenizer, the modules under
test) is inherited as it is rather than loaded again; they write nothing to
stderr (xgrammar prints its warnings there from C++).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable


def _child(conn, fn, job) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        conn.send(fn(*job))
    except Exception as e:  # noqa: BLE001 - this item's failure (the library refused it): reported, not fatal
        conn.send({"error": f"{type(e).__name__}: {str(e)[:200]}"})
    finally:
        conn.close()


def each_in_a_child(fn: Callable[..., dict], jobs: list[tuple], *, timeout: float, workers: int = 1,
                    budget_seconds: float = 0.0, on_done: Callable[[int, dict], None] | None = None) -> None:
    """fn(*job) for every job, `workers` children at a time, each killed `timeout` seconds after it started;
    no child starts once `budget_seconds` have passed (0: no budget). `on_done(index, outcome)` as each ends:
    fn's dict, {"error": why} (fn raised, or the child died without answering) or {"timeout": True}."""
    ctx = mp.get_context("fork")
    pending = list(enumerate(jobs))
    running: dict[int, tuple] = {}
    t0 = time.monotonic()
    while pending or running:
        if budget_seconds and time.monotonic() - t0 >= budget_seconds:
            pending.clear()
        while pending and len(running) < max(1, workers):
            i, job = pending.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(child, fn, job), daemon=True)
            proc.start()
            child.close()
            running[i] = (proc, parent, time.monotonic())
        for i, (proc, parent, started) in list(running.items()):
            outcome = None
            if parent.poll():
                try:
                    outcome = parent.recv()
                except EOFError:  # the child died without answering (its crash): counted as an error
                    outcome = {"error": f"worker exited with {proc.exitcode}"}
            elif not proc.is_alive():
                outcome = {"error": f"worker exited with {proc.exitcode}"}
            elif time.monotonic() - started > timeout:
                proc.kill()
                outcome = {"timeout": True}
            if outcome is None:
                continue
            proc.join()
            parent.close()
            del running[i]
            if on_done is not None:
                on_done(i, outcome)
        time.sleep(0.01)
