"""The JSON-Schema samples the schema benchmarks walk, and what they judge a document by.

`structd bench validity` and `structd bench json-grammar` both read the
JSONSchemaBench and MaskBench samples (../shared/data), walk grammars on the
default tokenizer with the same bias towards closing tokens, and validate
documents with `jsonschema` under each schema's own draft.
"""

from __future__ import annotations

import json
from pathlib import Path

# A walk's closing tokens: ones made only of these characters end a string, an object or an array.
CLOSING = frozenset('"}]')


def default_data(name: str) -> Path:
    return Path(__file__).resolve().parents[3] / "shared" / "data" / name


def read_jsonl(path, limit: int) -> list[dict]:
    """A JSON Lines sample's rows; with a limit, that many spread evenly over the file (keeps every category:
    they are contiguous)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if limit and limit < len(rows):
        rows = [rows[int(i * len(rows) / limit)] for i in range(limit)]
    return rows


def load_rows(jsonschemabench, maskbench, limit: int) -> list[dict]:
    """(source, category, name, schema) of every schema to run, file by file ('' skips a file); `limit`
    schemas per file (0: all)."""
    rows = []
    for source, path, category_key in (("jsonschemabench", jsonschemabench, "dataset"),
                                       ("maskbench", maskbench, "group")):
        if str(path) and str(path) != ".":
            rows += [{"source": source, "category": r[category_key], "name": r["name"], "schema": r["schema"]}
                     for r in read_jsonl(path, limit)]
    return rows


def default_vocab():
    """The default tokenizer's xgrammar TokenizerInfo, its tokens' bytes, and which of them are closing tokens."""
    import numpy as np
    import xgrammar as xgr

    from shared.tokenizer import default_description

    info = xgr.TokenizerInfo.deserialize_json(default_description().info_json)
    vocab = [bytes(t) for t in info.decoded_vocab]
    closing = np.array([bool(t) and set(t.decode("utf-8", "ignore")) <= CLOSING for t in vocab])
    return info, vocab, closing


def closing_bias(step: int, max_tokens: int) -> float:
    """How likely a walk picks a closing token where one is allowed: growing along the walk, so most finish."""
    return min(0.9, 0.15 + 1.5 * step / max_tokens)


def validation_cause(text: str, schema) -> str | None:
    """None when `text` is one JSON document valid against `schema`; else the cause of the first failure."""
    import jsonschema

    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not-json: {e.msg}"
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(cls(schema).iter_errors(doc))
    if error is None:
        return None
    return f"{error.validator}{' (root)' if not error.absolute_path and error.validator == 'type' else ''}"
