"""Whether a finished JSON document validates against its schema: the last response waits for the check.

The grammar tier compiles a schema into a grammar that may be looser than
the schema (keywords xgrammar ignores or approximates: compile warnings), so
a finished document is checked against the schema itself. The check runs on
the grammar tier (CheckOutput, in its worker processes); the last response
of the request waits for it, at most --schema-check-timeout-seconds, and
says UNCHECKED, with why, when it could not be had: a client is never left
to assume that an output it was not told about is valid. (What the grammar
does not enforce, the compile warnings, is told with the first response;
a strict_schema request is refused for them: grammar_tier.py.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from inference_svc.types import CheckResult, SchemaCheck

if TYPE_CHECKING:
    from inference_svc.engine.request import GenerationRequest, Output
    from inference_svc.grammar.grammar_tier import GrammarTier
    from inference_svc.metrics import InferenceMetrics

log = logging.getLogger(__name__)


def wants_check(req: "GenerationRequest") -> bool:
    """A json_schema request whose document is complete (finished by its grammar or end of sequence)."""
    return req.grammar is not None and req.grammar.constraint.kind == "json_schema"


class FinalChecks:
    """Holds each checked request's last response until its check is in (never the step loop)."""

    def __init__(self, tier: "GrammarTier", metrics: "InferenceMetrics", timeout_seconds: float):
        self.tier = tier
        self.metrics = metrics
        self.timeout_seconds = timeout_seconds
        self._tasks: set[asyncio.Task] = set()

    def deliver(self, req: "GenerationRequest", output: "Output", replica: int) -> None:
        """Puts `output` on the request's stream once its check is known; returns at once."""
        task = asyncio.ensure_future(self._run(req, output, replica, req.grammar.grammar_id, list(req.answer_ids)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, req: "GenerationRequest", output: "Output", replica: int, grammar_id: str,
                   ids: list[int]) -> None:
        try:
            check = await self.tier.check_output(replica, req.grammar.constraint, grammar_id, ids, self.timeout_seconds)
        except asyncio.CancelledError:  # the engine is closing: the output still goes out, told it is unchecked
            req.put_output(dataclasses.replace(output, schema_check=SchemaCheck(
                CheckResult.UNCHECKED, detail="the inference service stopped before the check finished")))
            raise
        except Exception as e:  # noqa: BLE001 - ours (a bug): the client still gets its output, told it is unchecked
            log.exception("request %s: schema check failed", req.request_id)
            check = SchemaCheck(CheckResult.UNCHECKED, detail=f"the schema check failed: {type(e).__name__}")
        self.metrics.schema_checks.labels(check.result.value).inc()
        req.put_output(dataclasses.replace(output, schema_check=check))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
