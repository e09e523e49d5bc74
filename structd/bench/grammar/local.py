"""`structd bench grammar`: the local pass, with xgrammar directly.

The wire carries one fill time per step (StepResponse.fill_duration_seconds,
wall time over all rows and threads), not per row. So after the walks the
benchmark replays every walked session in this process on the same grammars
(compiled here with the service's own compile_spec) and times each mask fill
on its own, single-threaded: the intrinsic cost of each row. On the way it

- checks every replayed mask against the hash of the mask the server sent
  (the replay is the same matcher state, or the numbers would mean nothing);
- classifies each row from the rules of the matcher's current parser states
  (a debug API: benchmark only): "bounded_string" inside a string with
  minLength/maxLength that xgrammar expands into nested rules (bounds up to
  ~127), "bounded_string_long" inside one it matches with its windowed repeat
  (longer bounds), else "other";
- optionally compiles each schema that has a bounded string a second time
  with the bounded-string rewrite (grammar_svc.schema.bounded_strings), replays the
  same tokens on it, checks that every mask is identical and times its fills
  (schemas without one count with their own fill times: nothing changes).

With `served=True` (`--local-grammar served`) the replay runs on the grammar
the service compiles (rewrites included) instead of xgrammar's own form,
whose rows inside strings longer than 128 characters take seconds each since
json-grammar-5: the per-row times (and the slowest row per step) are then
the service's, every row is "other", and there is nothing to compare.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import numpy as np

from grammar_svc.schema.bounded_strings import rewrite_bounded_strings
from grammar_svc.schema.json_grammar import compile_json_schema, json_schema_ebnf
from structd.bench.grammar.walks import WalkRun
from structd.bench.harness import progress
from grammar_svc.compile.spec import JsonOptions

# xgrammar 0.2.8 matches the characters of a string with minLength/maxLength
# with this class (plain strings use [^\0-\x1f"\\\r\n] plus escapes); bounds
# up to ~127 become nested optional rules, longer ones a windowed `_repeat_`.
_BOUNDED_CLASS = '[^\\"\\\\\\r\\n]'

_RULE_ID = re.compile(r"rule_id=(\d+)")


class quiet_stderr:
    """Sends fd 2 (where xgrammar's C++ code logs its schema warnings) to /dev/null meanwhile."""

    def __enter__(self):
        import sys

        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        return self

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)
        os.close(self._saved)


@dataclass
class LocalGrammar:
    compiled: object | None = None
    compile_seconds: float = 0.0
    bounded_rules: frozenset = frozenset()
    long_rules: frozenset = frozenset()
    rewritten: object | None = None
    rewrite_compile_seconds: float | None = None
    rewrite_rules: int = 0
    rewrite_error: str = ""
    rewrite_checked: bool = False
    error: str = ""


@dataclass
class LocalRows:
    """Per mask row of one walk run, parallel to WalkRun.row_*."""

    fill: list[float] = field(default_factory=list)
    rewrite_fill: list[float | None] = field(default_factory=list)
    klass: list[str] = field(default_factory=list)
    matches_server: list[bool] = field(default_factory=list)
    rewrite_matches: list[bool | None] = field(default_factory=list)


def _bounded_rule_ids(compiled) -> tuple[frozenset, frozenset]:
    """(rules of short bounded strings, rules of long ones); rule ids are the order the grammar prints them in."""
    short, long = set(), set()
    for i, line in enumerate(str(compiled.grammar).splitlines()):
        if _BOUNDED_CLASS in line:
            (long if "_repeat_" in line else short).add(i)
    return frozenset(short), frozenset(long)


def compile_locally(info, schema_texts: dict[int, str], rewrite: bool, threads: int | None = None,
                    progress_every: int = 25, served: bool = False) -> dict[int, LocalGrammar]:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(info, max_threads=threads or os.cpu_count() or 1, cache_enabled=False)
    opts = JsonOptions()
    out: dict[int, LocalGrammar] = {}
    t0 = time.perf_counter()
    for n, (key, text) in enumerate(sorted(schema_texts.items()), 1):
        g = LocalGrammar()
        out[key] = g
        try:
            start = time.perf_counter()
            with quiet_stderr():
                # xgrammar's own form (the service compiles the rewritten one): rows are classified by its rules.
                g.compiled = compile_json_schema(compiler, text, opts, rewrite=served)
            g.compile_seconds = time.perf_counter() - start
            if not served:
                g.bounded_rules, g.long_rules = _bounded_rule_ids(g.compiled)
        except Exception as e:  # noqa: BLE001 - recorded, the grammar's rows are skipped
            g.error = f"{type(e).__name__}: {e}"
            continue
        if rewrite and not served:
            g.rewrite_checked = True
            try:
                with quiet_stderr():
                    ebnf, g.rewrite_rules = rewrite_bounded_strings(json_schema_ebnf(text, opts))
                if g.rewrite_rules:
                    start = time.perf_counter()
                    g.rewritten = compiler.compile_grammar(ebnf)
                    g.rewrite_compile_seconds = time.perf_counter() - start
            except Exception as e:  # noqa: BLE001
                g.rewrite_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if n % progress_every == 0 or n == len(schema_texts):
            progress(f"local compile {n}/{len(schema_texts)} ({time.perf_counter() - t0:.0f} s)")
    return out


def replay(run: WalkRun, grammars: dict[int, LocalGrammar], walk_grammar_keys: list[int], vocab_size: int) -> LocalRows:
    """Replays every session of a walk run; returns per-row local measurements."""
    import xgrammar as xgr

    rows = LocalRows()
    n = len(run.row_step)
    rows.fill = [float("nan")] * n
    rows.rewrite_fill = [None] * n
    rows.klass = ["unknown"] * n
    rows.matches_server = [False] * n
    rows.rewrite_matches = [None] * n
    by_session: dict[int, list[tuple[int, int]]] = {}
    for i in range(n):
        by_session.setdefault(run.row_session[i], []).append((run.row_position[i], i))
    buf = xgr.allocate_token_bitmask(1, vocab_size)
    buf2 = xgr.allocate_token_bitmask(1, vocab_size)
    perf = time.perf_counter
    for sess_index, wanted in by_session.items():
        sess = run.sessions[sess_index]
        g = grammars.get(walk_grammar_keys[sess.grammar])
        if g is None or g.compiled is None:
            continue
        wanted.sort()
        m = xgr.GrammarMatcher(g.compiled)
        m2 = xgr.GrammarMatcher(g.rewritten) if g.rewritten is not None else None
        pos = 0
        for position, i in wanted:
            while pos < position:
                tok = sess.tokens[pos]
                m.accept_token(tok)
                if m2 is not None and not m2.accept_token(tok):
                    m2 = None
                    rows.rewrite_matches[i] = False
                pos += 1
            start = perf()
            m.fill_next_token_bitmask(buf)
            rows.fill[i] = perf() - start
            row = buf[0].numpy()
            rows.matches_server[i] = hash(row.tobytes()) == run.row_hash[i]
            rows.klass[i] = "other"
            if g.bounded_rules or g.long_rules:
                state = m._debug_print_internal_state()
                ids = {int(x) for x in _RULE_ID.findall(state.split("Last step:", 1)[-1])}
                if ids & g.bounded_rules:
                    rows.klass[i] = "bounded_string"
                elif ids & g.long_rules:
                    rows.klass[i] = "bounded_string_long"
            if g.rewrite_checked and g.rewrite_rules == 0 and not g.rewrite_error:
                # Nothing to rewrite: the service would compile the schema as it is.
                rows.rewrite_fill[i] = rows.fill[i]
            elif m2 is not None:
                start = perf()
                m2.fill_next_token_bitmask(buf2)
                rows.rewrite_fill[i] = perf() - start
                rows.rewrite_matches[i] = bool(np.array_equal(buf2.numpy(), buf.numpy()))
    return rows
