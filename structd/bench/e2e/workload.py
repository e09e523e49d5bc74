"""`structd bench e2e`: the workload, shared by structd and every peer.

The JSONSchemaBench schemas are too open for a random-weight model: inside
an unbounded string or number it never stops. These schemas bound everything
(strings by maxLength or a fixed-length pattern, integers by ranges, arrays by
maxItems, enums), so a constrained completion usually ends on its own within
the token budget. They are varied on purpose: enums and booleans (masks of a
few ids, jump-forward over the keys), integer ranges (digit masks), short
bounded strings (xgrammar's slow-fill case, see docs/benchmarks.md), arrays
of objects.

Unconstrained requests use the same prompts (so prefill is the same) with
ignore_eos, so both kinds run to comparable lengths; constrained requests may
stop earlier, when their JSON is complete. Every figure is per token actually
generated.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _str(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


SCHEMAS: list[tuple[str, dict]] = [
    ("user", _obj({"name": _str(12), "age": _int(0, 120), "active": {"type": "boolean"}})),
    ("product", _obj({"sku": _str(8), "price_cents": _int(0, 99999),
                      "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]}, "in_stock": {"type": "boolean"}})),
    ("event", _obj({"kind": {"enum": ["meeting", "call", "deadline", "holiday"]}, "day": _int(1, 31),
                    "month": _int(1, 12),
                    "tags": {"type": "array", "items": {"enum": ["work", "home", "urgent", "later"]},
                             "maxItems": 3}})),
    ("points", _obj({"points": {"type": "array", "items": _obj({"x": _int(-100, 100), "y": _int(-100, 100)}),
                                "maxItems": 4}})),
    ("address", _obj({"city": _str(16), "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                      "country": {"enum": ["US", "DE", "FR", "JP", "BR"]}})),
    ("review", _obj({"score": _int(1, 5), "comment": _str(24), "recommend": {"type": "boolean"}})),
    ("config", _obj({"level": {"enum": ["debug", "info", "warn", "error"]}, "retries": _int(0, 10),
                     "timeout_ms": _int(100, 60000),
                     "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}})),
    ("order", _obj({"id": _int(1, 1000000),
                    "items": {"type": "array", "items": _obj({"sku": _str(6), "qty": _int(1, 9)}), "maxItems": 3},
                    "status": {"enum": ["new", "paid", "shipped", "cancelled"]}})),
]

PROMPTS: list[str] = [
    "Describe the user who just signed up as JSON:",
    "Give the product record for the item on the shelf:",
    "Add the following event to the calendar:",
    "List the corner points of the shape:",
    "Write the shipping address of the customer:",
    "Summarize the customer's review of the restaurant:",
    "Produce the service configuration for production:",
    "Record the order that was placed this morning:",
]


@dataclass(frozen=True)
class Work:
    """One request of the workload: prompt, schema (None: unconstrained), its index in the set."""

    index: int
    prompt: str
    schema_name: str | None
    schema: dict | None

    @property
    def constrained(self) -> bool:
        return self.schema is not None

    @property
    def schema_text(self) -> str | None:
        return None if self.schema is None else json.dumps(self.schema)


def work(kind: str, count: int, offset: int = 0) -> list[Work]:
    """`count` requests of kind "constrained", "unconstrained" or "mixed" (alternating), cycling the set."""
    out = []
    for j in range(count):
        i = (offset + j) % len(SCHEMAS)
        constrained = kind == "constrained" or (kind == "mixed" and j % 2 == 0)
        name, schema = SCHEMAS[i]
        out.append(Work(i, PROMPTS[i], name if constrained else None, schema if constrained else None))
    return out


def digest(token_ids) -> str:
    """A short hash of a request's generated token ids: the records of structd and of every peer carry it, so
    runs can be compared token for token."""
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]
