"""Next-token sampling for the engine's step loop: validated options, per-request RNG, one call per step.

`SamplingOptions` is the domain form of `inference.v1.SamplingParams` (proto
defaults applied, bad values rejected with `InvalidRequestError`). Each request
owns a `RowSampler`: its options and its own `torch.Generator`. `sample`
turns a step's logits (grammar masks already applied as -inf) into one token
per row: greedy rows by one batched argmax, the others by temperature, top_k,
top_p, min_p and an inverse-CDF draw that takes exactly one uniform from the row's
generator. A row's draw therefore depends only on its own logits and its own
history, never on which or how many other rows share the step.

The sampled rows are drawn as a batch (`_sample_batch`), a few tensor ops per
group and a host wait per group, not per row: rows that nothing truncates by
one softmax over the vocabulary and a CDF found block by block; rows under
top_k, top_p or min_p among their likeliest tokens (one top-k for the
group), cut there and drawn in the row path's order; rows with an allowed-id
list among their ids. The row path (`_sample_row`) remains for the rows the
batch cannot take exactly: a temperature so small that logits / temperature
overflows float32, a non-finite row, and a top_p or min_p whose cut reaches
past the row's `_NUCLEUS_CANDIDATES` likeliest tokens (a nearly flat row).

Rows that ask for logprobs also get the chosen token's log probability and the
most likely alternatives from the very distribution the token was drawn from
(`sample_with_logprobs`); rows that do not ask pay nothing for it. The
logit bias (`add_at`), the repetition penalty (`apply_repetition_penalty`),
the presence and frequency penalties (`apply_occurrence_penalties`) and the
EOS ban of `min_tokens` (`ban_unless_only`) rewrite logits in place before the
draw, in vLLM's order (bias, repetition, presence/frequency; `adjust_rows` does
the three for a step's rows at once), all before the grammar's mask; the ids a penalty reads are kept per request, grown by each
step's new tokens (`SeenTokens`, `OutputCounts`). A request that asks for none
of them has `RowSampler.adjusts` False and costs nothing for them.

On the CPU the inverse-CDF draw is far cheaper than torch.multinomial or an exponential race (whose noise
alone costs more than the draw), and numpy's argmax and sort are several times faster than torch's, hence
numpy for the greedy rows and the row path there (docs/benchmarks.md, "Hand-timed figures behind code
choices", "Sampling on the CPU", has the timings; `structd bench sampler` measures the batch against the
row path).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shared.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
# As OpenAI's API (and vLLM's and SGLang's servers by default): alternatives cost a sort per token.
MAX_TOP_LOGPROBS = 20
# As OpenAI's API.
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
MAX_OCCURRENCE_PENALTY = 2.0  # presence and frequency penalties are in [-2, 2], as OpenAI's and vLLM's
MAX_STOP_TOKEN_IDS = 64
_UINT64_MAX = 2**64 - 1
# A little under float32's max (3.4e38): logits divided by the temperature must stay below it.
_OVERFLOW_GUARD = 1e38


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    max_tokens: int
    temperature: float
    top_p: float  # 1.0 = disabled
    top_k: int  # 0 = disabled
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    repetition_penalty: float = 1.0  # 1.0 = disabled
    n: int = 1  # completions of the prompt, each its own sequence (seed + index where a seed is given)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by id
    min_p: float = 0.0  # 0 = disabled
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False

    @classmethod
    def validated(
        cls,
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        stop: Sequence[str],
        ignore_eos: bool,
        default_max_tokens: int,
        max_max_tokens: int,
        logprobs: bool = False,
        top_logprobs: int = 0,
        min_tokens: int = 0,
        repetition_penalty: float = 0.0,
        n: int = 0,
        max_n: int = 1,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        min_p: float = 0.0,
        stop_token_ids: Sequence[int] = (),
        include_stop_str_in_output: bool = False,
    ) -> SamplingOptions:
        """Applies the proto's defaults (0 = server default / disabled) and rejects out-of-range values."""
        if not 0 <= max_tokens <= max_max_tokens:
            raise InvalidRequestError(
                f"max_tokens must be in [0, {max_max_tokens}] (0 = server default {default_max_tokens}), "
                f"got {max_tokens}"
            )
        if not (math.isfinite(temperature) and temperature >= 0):
            raise InvalidRequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
        if not 0.0 <= top_p <= 1.0:  # also rejects NaN
            raise InvalidRequestError(f"top_p must be in [0, 1] (0 or 1 = disabled), got {top_p}")
        if top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = disabled), got {top_k}")
        if seed is not None and not 0 <= seed <= _UINT64_MAX:
            raise InvalidRequestError(f"seed must be in [0, 2**64 - 1], got {seed}")
        stop = tuple(stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for i, s in enumerate(stop):
            if not 1 <= len(s) <= MAX_STOP_LENGTH:
                raise InvalidRequestError(
                    f"stop[{i}] must be 1 to {MAX_STOP_LENGTH} characters long, got {len(s)}"
                )
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
        max_tokens = max_tokens or default_max_tokens
        if not 0 <= min_tokens <= max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens] (max_tokens is {max_tokens} here), got {min_tokens}")
        if not (math.isfinite(repetition_penalty) and repetition_penalty >= 0):
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0 (0 or 1 = disabled), got {repetition_penalty}")
        if not 0 <= n <= max_n:
            raise InvalidRequestError(f"n must be in [0, {max_n}] (0 = 1; the server's --max-n is {max_n}), got {n}")
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not -MAX_OCCURRENCE_PENALTY <= value <= MAX_OCCURRENCE_PENALTY:  # also rejects NaN
                raise InvalidRequestError(
                    f"{name} must be in [-{MAX_OCCURRENCE_PENALTY:g}, {MAX_OCCURRENCE_PENALTY:g}] (0 = disabled), "
                    f"got {value}")
        bias = _logit_bias(logit_bias or {})
        if not 0.0 <= min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 = disabled), got {min_p}")
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}")
        for i, t in enumerate(stop_token_ids):
            if t < 0:
                raise InvalidRequestError(f"stop_token_ids[{i}]: {t} is not a token id")
        return cls(
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_p=1.0 if top_p in (0.0, 1.0) else float(top_p),
            top_k=top_k,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            logprobs=bool(logprobs),
            top_logprobs=top_logprobs,
            min_tokens=min_tokens,
            repetition_penalty=1.0 if repetition_penalty == 0.0 else float(repetition_penalty),
            n=n or 1,
            presence_penalty=float(presence_penalty),
            frequency_penalty=float(frequency_penalty),
            logit_bias=bias,
            min_p=float(min_p),
            stop_token_ids=frozenset(stop_token_ids),
            include_stop_str_in_output=bool(include_stop_str_in_output),
        )

    def for_completion(self, index: int) -> SamplingOptions:
        """The options of completion `index` of n: its own seed (seed + index, wrapping at 2**64), so that
        seeded completions differ from each other and each is reproducible."""
        if index == 0 or self.seed is None:
            return self
        return dataclasses.replace(self, seed=(self.seed + index) % (_UINT64_MAX + 1))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    def check_token_ids(self, vocab_size: int) -> None:
        """Rejects a logit_bias or stop_token_ids id that is no token of a vocabulary of `vocab_size` ids."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = sorted(t for t in ids if not 0 <= t < vocab_size)
            if bad:
                raise InvalidRequestError(
                    f"{name}: {bad[0]} is not a token id of this model (0 to {vocab_size - 1})"
                    + (f", and {len(bad) - 1} more" if len(bad) > 1 else ""))


def _logit_bias(bias: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias allows at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
    for t, v in bias.items():
        if t < 0:
            raise InvalidRequestError(f"logit_bias: {t} is not a token id")
        if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:  # also rejects NaN
            raise InvalidRequestError(
                f"logit_bias[{t}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {v}")
    # A zero bias changes nothing: leaving it out keeps a request of zeros on the path that costs nothing.
    return tuple(sorted((int(t), float(v)) for t, v in bias.items() if v != 0.0))


class SeenTokens:
    """The distinct ids of a request's prompt + output, for its repetition penalty.

    Grown from the request's token list by what was appended since the last
    call, so a step costs its new tokens, not a pass over the whole history.
    """

    __slots__ = ("_seen", "_ids", "_count", "_absorbed")

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self._ids = np.empty(64, dtype=np.int64)
        self._count = 0
        self._absorbed = 0  # how many of the request's tokens are in _seen

    def update(self, all_ids: Sequence[int]) -> np.ndarray:
        """The distinct ids of `all_ids` (prompt + output so far), in no particular order."""
        if len(all_ids) < self._absorbed:
            # The history got shorter (a rollback): start over rather than guess what left.
            self._seen.clear()
            self._count = self._absorbed = 0
        new = all_ids[self._absorbed:]
        self._absorbed = len(all_ids)
        if len(new) > 64:
            # A prompt: one vectorised pass instead of a Python loop over every token.
            new = np.unique(np.asarray(new, dtype=np.int64)).tolist()
        fresh = [t for t in dict.fromkeys(new) if t not in self._seen]
        if fresh:
            self._seen.update(fresh)
            need = self._count + len(fresh)
            if need > self._ids.shape[0]:
                grown = np.empty(max(need, 2 * self._ids.shape[0]), dtype=np.int64)
                grown[:self._count] = self._ids[:self._count]
                self._ids = grown
            self._ids[self._count:need] = fresh
            self._count = need
        return self._ids[:self._count]


class OutputCounts:
    """How often each id occurs in a request's output (not its prompt), for presence and frequency penalties.

    Grown as `SeenTokens` is, by what was appended since the last call.
    """

    __slots__ = ("_at", "_ids", "_counts", "_n", "_absorbed")

    def __init__(self) -> None:
        self._at: dict[int, int] = {}  # id -> its position in _ids / _counts
        self._ids = np.empty(64, dtype=np.int64)
        self._counts = np.empty(64, dtype=np.float32)
        self._n = 0
        self._absorbed = 0  # how many of the request's tokens (prompt included) are counted

    def update(self, all_ids: Sequence[int], num_prompt: int) -> tuple[np.ndarray, np.ndarray]:
        """The distinct ids of all_ids[num_prompt:] and how often each occurs there (float32)."""
        if len(all_ids) < self._absorbed:
            # The history got shorter (a rollback): start over rather than guess what left.
            self._at.clear()
            self._n = self._absorbed = 0
        start = max(self._absorbed, num_prompt)
        self._absorbed = max(len(all_ids), num_prompt)
        for t in all_ids[start:]:
            at = self._at.get(t)
            if at is not None:
                self._counts[at] += 1
                continue
            if self._n == self._ids.shape[0]:
                self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
                self._counts = np.concatenate([self._counts, np.empty_like(self._counts)])
            self._at[t] = self._n
            self._ids[self._n] = t
            self._counts[self._n] = 1
            self._n += 1
        return self._ids[:self._n], self._counts[:self._n]


class RowSampler:
    """One request's sampling state: its options, a generator nobody else draws from, the ids it has seen
    (repetition penalty), its output's counts (presence and frequency penalties) and its logit bias."""

    __slots__ = ("options", "generator", "seen", "counts", "bias", "adjusts")

    def __init__(self, options: SamplingOptions, device: torch.device | str = "cpu"):
        self.options = options
        self.generator = torch.Generator(device=device)
        seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.generator.manual_seed(seed)
        # Only a penalised request pays for tracking its history.
        self.seen = SeenTokens() if options.repetition_penalty != 1.0 else None
        occurrence = options.presence_penalty != 0.0 or options.frequency_penalty != 0.0
        self.counts = OutputCounts() if occurrence else None
        # (ids, biases) as host tensors, made once. Not on the device: a RowSampler is made on the event loop,
        # where a copy to a GPU waits for the forward in flight (a pageable copy syncs its stream); the step's
        # biases go over in one copy on the device thread instead (adjust_rows).
        self.bias = None
        if options.logit_bias:
            ids, values = zip(*options.logit_bias)
            self.bias = (torch.tensor(ids, dtype=torch.long), torch.tensor(values, dtype=torch.float32))
        # Whether the logits need rewriting before the mask: the one check a step makes for every row.
        self.adjusts = self.seen is not None or self.counts is not None or self.bias is not None

    @property
    def argmax_only(self) -> bool:
        # top_k=1 is greedy too; routing it to argmax also keeps it exact on ties.
        return self.options.greedy or self.options.top_k == 1


@dataclass(frozen=True, slots=True)
class RowLogprobs:
    """A drawn token's log probability and the likeliest alternatives, from the distribution it was drawn from."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's logprob as a response carries it; forced tokens have logprob 0 and no alternatives."""

    token_id: int
    token_bytes: bytes
    logprob: float
    forced: bool = False
    top: tuple[TopLogprob, ...] = ()


@torch.inference_mode()
def add_at(logits: torch.Tensor, row: int, ids: torch.Tensor, values: torch.Tensor) -> None:
    """logits[row, ids] += values, in place (ids distinct; -inf stays -inf, so a masked or uncomputed
    column stays undrawable whatever the bias)."""
    logits[row].index_add_(0, ids.to(logits.device), values.to(logits.device, logits.dtype))


@torch.inference_mode()
def apply_occurrence_penalties(logits: torch.Tensor, row: int, ids: np.ndarray, counts: np.ndarray,
                               presence: float, frequency: float) -> None:
    """OpenAI's presence and frequency penalties on one row, in place, as vLLM computes them:
    logits[t] -= frequency * count[t] + presence * (count[t] > 0) for the output's distinct ids `ids`."""
    if not ids.size:
        return
    x = logits[row]
    amount = counts * np.float32(frequency) + np.float32(presence)
    x.index_add_(0, torch.from_numpy(ids).to(x.device), torch.from_numpy(-amount).to(x.device, x.dtype))


@torch.inference_mode()
def apply_repetition_penalty(logits: torch.Tensor, row: int, ids: np.ndarray, penalty: float) -> None:
    """Hugging Face's RepetitionPenaltyLogitsProcessor on one row, in place: the logits of `ids`
    are divided by `penalty` where positive and multiplied where negative (-inf stays -inf)."""
    if not ids.size:
        return
    x = logits[row]
    at = torch.from_numpy(ids).to(x.device)
    values = x.index_select(0, at)
    x.index_copy_(0, at, torch.where(values < 0, values * penalty, values / penalty))


@torch.inference_mode()
def adjust_rows(logits: torch.Tensor, bias: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
                penalties: Sequence[tuple[int, np.ndarray, float]],
                occurrences: Sequence[tuple[int, np.ndarray, np.ndarray, float, float]]) -> set[int]:
    """`add_at`, `apply_repetition_penalty` and `apply_occurrence_penalties` for every listed row at once, in
    that order, one indexed op each over the flattened logits; returns the rows left untouched because an id
    of theirs is no column of `logits` (checked before anything is written, so the others are exact).

    `logits` must be contiguous (the ops write through a flat view).
    """
    width = logits.shape[1]
    flat = logits.view(-1)
    device = logits.device
    bad: set[int] = set()
    if bias:
        # Built on the host (RowSampler keeps its bias there), checked there (no wait for the device), and
        # copied over once for the step.
        ids = torch.cat([t.cpu() for _, t, _ in bias])
        lengths = torch.tensor([t.shape[0] for _, t, _ in bias])
        row = torch.repeat_interleave(torch.tensor([i for i, _, _ in bias]), lengths)
        outside = (ids < 0) | (ids >= width)
        if bool(outside.any()):
            bad.update(row[outside].tolist())
        keep = ~torch.isin(row, torch.tensor(sorted(bad), dtype=row.dtype)) if bad else None
        at, values = ids + row * width, torch.cat([v.cpu() for _, _, v in bias])
        if keep is not None:
            at, values = at[keep], values[keep]
        flat.index_add_(0, at.to(device), values.to(device, logits.dtype))
    rep = [(i, ids, p) for i, ids, p in penalties if _inside(ids, width, i, bad)]
    if rep:
        at = torch.from_numpy(np.concatenate([ids + i * width for i, ids, _ in rep])).to(device)
        factor = torch.from_numpy(np.concatenate([np.full(ids.size, p, dtype=np.float32) for _, ids, p in rep]))
        factor = factor.to(device, logits.dtype)
        values = flat.index_select(0, at)
        flat.index_copy_(0, at, torch.where(values < 0, values * factor, values / factor))
    occ = [entry for entry in occurrences if _inside(entry[1], width, entry[0], bad)]
    if occ:
        at = torch.from_numpy(np.concatenate([ids + i * width for i, ids, _, _, _ in occ])).to(device)
        amount = np.concatenate([counts * np.float32(f) + np.float32(pr) for _, _, counts, pr, f in occ])
        flat.index_add_(0, at, torch.from_numpy(-amount).to(device, logits.dtype))
    return bad


def _inside(ids: np.ndarray, width: int, row: int, bad: set[int]) -> bool:
    """Whether every id is a column (else `row` joins `bad`); rows already bad stay out."""
    if row in bad:
        return False
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= width):
        bad.add(row)
        return False
    return True


@torch.inference_mode()
def ban_unless_only(logits: torch.Tensor, row: int, banned: np.ndarray,
                    candidates: np.ndarray | None) -> np.ndarray | None:
    """Takes the `banned` ids out of one row unless nothing else is left to draw; returns the row's candidates.

    A row restricted to an allowed-id list (`candidates`) loses them from the
    list; any other row gets -inf at them (and its values back, should that
    leave no finite logit).
    """
    if candidates is not None:
        keep = ~np.isin(candidates, banned)
        return candidates[keep] if keep.any() else candidates
    x = logits[row]
    at = torch.from_numpy(banned).to(x.device)
    before = x.index_select(0, at)
    x.index_fill_(0, at, float("-inf"))
    if not bool(torch.isfinite(x.max())):
        x.index_copy_(0, at, before)
    return None


@torch.inference_mode()
def ban_rows_unless_only(logits: torch.Tensor, rows: Sequence[int], banned: Sequence[np.ndarray]) -> None:
    """`ban_unless_only` for rows without candidate lists, all at once and with no host wait: -inf at each
    row's banned ids, and the row's values back where that leaves it nothing finite. `logits` must be
    contiguous (the ops write through a flat view); each row's banned ids are distinct columns."""
    if not rows:
        return
    width = logits.shape[1]
    flat = logits.view(-1)
    device = logits.device
    lengths = [b.size for b in banned]
    at = torch.from_numpy(np.concatenate([b + r * width for r, b in zip(rows, banned)])).to(device)
    owner = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths)).to(device)
    before = flat.index_select(0, at)
    flat.index_fill_(0, at, float("-inf"))
    empty = ~torch.isfinite(logits.index_select(0, torch.tensor(list(rows), device=device)).amax(1))
    flat.index_copy_(0, at, torch.where(empty[owner], before, flat.index_select(0, at)))


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: Sequence[RowSampler], row_index: Sequence[int] | None = None,
           candidates: Sequence[np.ndarray | None] | None = None) -> list[int]:
    """One token id per sampler; rows[i] draws from logits[row_index[i]] (default: row i).

    float32 `logits` [n, V]; -inf entries are never drawn; a row with nothing
    drawable (a NaN logit, or all -inf) gives the id of a logit that is not
    finite, for the caller to refuse. `logits` is only read, never written, and
    rows nobody draws from are never copied. candidates[i], when given, is the
    sorted int64 array of the only token ids rows[i] may draw (a grammar mask
    that came as an allowed-id list): the draw reads just those logits, which is
    the masked row's distribution (same order, same single uniform) at a
    fraction of the cost of masking and normalising 129k entries.
    """
    return sample_with_logprobs(logits, rows, row_index, candidates)[0]


@torch.inference_mode()
def sample_with_logprobs(logits: torch.Tensor, rows: Sequence[RowSampler], row_index: Sequence[int] | None = None,
                         candidates: Sequence[np.ndarray | None] | None = None,
                         ) -> tuple[list[int], list[RowLogprobs | None]]:
    """`sample`, plus each drawn token's `RowLogprobs` for the rows whose options ask (None for the others).

    The logprobs are those of the distribution the token was drawn from: after
    top_k, temperature, top_p and min_p, renormalised over what survives; for
    argmax rows (greedy, top_k 1) the log_softmax of the row at temperature 1.
    Tokens of probability 0 (masked, cut) are never among the alternatives, so
    a row may have fewer than top_logprobs of them.
    """
    index = list(range(len(rows))) if row_index is None else list(row_index)
    if logits.dim() != 2 or len(index) != len(rows) or (index and not 0 <= min(index) <= max(index) < logits.shape[0]):
        raise ValueError(f"logits [{', '.join(map(str, logits.shape))}] do not have the rows "
                         f"{len(rows)} samplers draw from")
    out = [0] * len(rows)
    logprobs: list[RowLogprobs | None] = [None] * len(rows)
    subset = [False] * len(rows)
    listed = []  # sampled rows with an allowed-id list
    # The logits as numpy where its argmax is the fast one (CPU float32), else None.
    x = logits.detach().numpy() if numpy_fast(logits) else None
    if candidates is not None:
        # A greedy row without logprobs is one numpy gather and argmax: torch's index_select and argmax cost
        # far more a row in dispatch, and a step holds dozens of such rows (docs/benchmarks.md,
        # "Sampling on the CPU").
        for i, ids in enumerate(candidates):
            if ids is None:
                continue
            subset[i] = True
            if not rows[i].argmax_only:
                listed.append(i)
            elif x is not None and not rows[i].options.wants_logprobs:
                out[i] = int(ids[x[index[i], ids].argmax()])
            else:
                sub = logits[index[i]].index_select(0, torch.from_numpy(ids).to(logits.device))
                pos = int(sub.argmax())
                out[i] = int(ids[pos])
                if rows[i].options.wants_logprobs:
                    lp = _greedy_logprobs(sub, pos, rows[i].options.top_logprobs)
                    logprobs[i] = RowLogprobs(lp.logprob, tuple((int(ids[p]), v) for p, v in lp.top))
    greedy = [i for i, r in enumerate(rows) if r.argmax_only and not subset[i]]
    if greedy:
        wanted = [index[i] for i in greedy]
        if 2 * len(wanted) >= logits.shape[0]:
            # An argmax over every row is cheaper than gathering most of them first.
            best = _argmax_rows(logits)
            picked = [best[j] for j in wanted]
        elif x is not None:
            # Row by row on views: gathering the rows first copies 0.5 MB each.
            picked = [int(x[j].argmax()) for j in wanted]
        else:
            picked = _argmax_rows(logits[wanted])
        asked = []
        for i, token in zip(greedy, picked):
            out[i] = token
            if rows[i].options.wants_logprobs:
                asked.append(i)
        if asked and x is None:
            # Off the CPU, one log_softmax and one top-k for these rows: row by row, each waits on the host.
            tops = _greedy_logprobs_rows(logits, [index[i] for i in asked], [out[i] for i in asked],
                                         [rows[i].options.top_logprobs for i in asked])
            for i, lp in zip(asked, tops):
                logprobs[i] = lp
        else:
            for i in asked:
                logprobs[i] = _greedy_logprobs(logits[index[i]], out[i], rows[i].options.top_logprobs)
    whole = [i for i, r in enumerate(rows) if not r.argmax_only and not subset[i]]
    if whole or listed:
        _sample_batch(logits, rows, index, candidates, whole, listed, out, logprobs)
    return out, logprobs


# A whole row (no allowed-id list) under top_p or min_p but no top_k is drawn among its this many likeliest tokens
# (one top-k of the row instead of a sort) whenever they hold everything the cut keeps; a flatter row takes the
# row path (`_sample_row`).
_NUCLEUS_CANDIDATES = 512
# Columns per block: `_top` keeps the blocks whose maxima are the largest, `_draw_blocked` finds the block first.
_TOP_BLOCK = 32
_DRAW_BLOCK = 128


def _truncates(o: SamplingOptions, width: int) -> bool:
    return 0 < o.top_k < width or o.top_p < 1.0 or o.min_p > 0.0


def _sample_batch(logits: torch.Tensor, rows: Sequence[RowSampler], index: list[int],
                  candidates: Sequence[np.ndarray | None] | None, whole: list[int], listed: list[int],
                  out: list[int], logprobs: list[RowLogprobs | None]) -> None:
    """Draws the sampled rows (not argmax) in a few tensor ops per group, writing out[i] and logprobs[i].

    Three groups: whole rows that nothing truncates (temperature only: a softmax over the vocabulary),
    whole rows under top_k/top_p/min_p (among their likeliest tokens), and rows with an allowed-id list
    (among those ids). Each row still draws exactly one uniform from its own generator and inverts its CDF
    in the order the row path does (vocabulary order; under top_k, likeliest first), so its token depends
    only on its own logits and generator. The host waits once per group for the rows the batch cannot take
    (a float32 overflow at a tiny temperature, a nucleus wider than the candidates): those take the row path.
    """
    width = logits.shape[1]
    device = logits.device
    plain = [i for i in whole if not _truncates(rows[i].options, width)]
    cut = [i for i in whole if _truncates(rows[i].options, width)]
    fallback: list[int] = []
    if plain:
        x = _rows(logits, [index[i] for i in plain])
        temps = torch.tensor([rows[i].options.temperature for i in plain], dtype=torch.float64, device=device)
        overflow = _overflows(x.amax(1), temps)
        probs = torch.softmax(x / temps.to(x.dtype).unsqueeze(1), 1)
        keep = _split(plain, overflow, fallback)
        if any(keep):
            u = _uniforms([rows[i] for i in plain], keep, device)
            j, total = _draw_blocked(probs, u)
            _emit(plain, keep, rows, j, None, probs, total, out, logprobs)
    for group, v, ix, own, outside, bad in _cut_groups(logits, rows, index, candidates, cut, listed):
        w, uncovered = _truncated_weights(v, ix, [rows[i].options for i in group], width, own, outside)
        keep = _split(group, uncovered | bad, fallback)
        if any(keep):
            u = _uniforms([rows[i] for i in group], keep, device)
            j, total = _draw_dense(w, u)
            _emit(group, keep, rows, j, ix, w, total, out, logprobs)
    for i in fallback:
        ids = candidates[i] if candidates is not None else None
        if ids is None:
            out[i], logprobs[i] = _sample_row(logits[index[i]], rows[i])
            continue
        # Only the allowed ids: the whole row would let a token the constraint forbids be drawn wherever the
        # allowed ones are not finite, and the step's finiteness check would not see it.
        at = torch.from_numpy(ids).to(logits.device)
        j, lp = _sample_row(logits[index[i]].index_select(0, at), rows[i])
        out[i] = int(ids[j])
        if lp is not None:
            lp = RowLogprobs(lp.logprob, tuple((int(ids[p]), v) for p, v in lp.top))
        logprobs[i] = lp


def _rows(logits: torch.Tensor, at: list[int]) -> torch.Tensor:
    """logits[at], without a copy when `at` is every row in order."""
    if at == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(at, device=logits.device))


def _overflows(peak: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    # Where x / temperature would overflow float32 (or divide by a temperature float32 rounds to zero): those
    # rows shift and divide in float64 on the row path (`_softmax`). So do rows whose peak is not finite (NaN
    # anywhere, or nothing drawable): the row path's token for them is what the step's checks expect.
    return (peak.double().abs() + 1.0 >= temps * _OVERFLOW_GUARD) | ~torch.isfinite(peak)


def _split(group: list[int], bad: torch.Tensor, fallback: list[int]) -> list[bool]:
    """Which rows of `group` the batch draws (one host sync); the others join `fallback`."""
    flags = bad.tolist()
    fallback.extend(i for i, b in zip(group, flags) if b)
    return [not b for b in flags] if any(flags) else [True] * len(group)


def _uniforms(rows: list[RowSampler], keep: list[bool], device: torch.device) -> torch.Tensor:
    """One uniform from each kept row's own generator (rows not kept draw nothing: the row path draws theirs)."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([torch.rand((), generator=r.generator, dtype=torch.float64, device=device) if k else zero
                        for r, k in zip(rows, keep)])


def _draw_dense(w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's position whose CDF first exceeds u * total (never a weight 0, as `_sample_row`), and the total."""
    cdf = torch.cumsum(w, 1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    j = torch.minimum(torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True), torch.searchsorted(cdf, total))
    return j.clamp_(max=w.shape[1] - 1).squeeze(1), total.squeeze(1)


def _draw_blocked(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_draw_dense` over whole rows without a float64 CDF of every column: the block the draw lands in from the
    blocks' sums, then the position within it."""
    b, width = probs.shape
    bs = _DRAW_BLOCK
    full = width // bs
    sums = [probs[:, :full * bs].reshape(b, full, bs).sum(2)] if full else []
    if width > full * bs:
        sums.append(probs[:, full * bs:].sum(1, keepdim=True))
    cum = torch.cumsum(torch.cat(sums, 1), 1, dtype=torch.float64)
    total = cum[:, -1:].contiguous()
    target = u.unsqueeze(1) * total
    blk = torch.minimum(torch.searchsorted(cum, target, right=True), torch.searchsorted(cum, total))
    blk.clamp_(max=cum.shape[1] - 1)
    before = torch.where(blk > 0, cum.gather(1, (blk - 1).clamp(min=0)), 0.0)
    cols = blk * bs + torch.arange(bs, device=probs.device)
    inside = probs.gather(1, cols.clamp(max=width - 1))
    inside = torch.where(cols < width, inside, 0.0)
    inner = before + torch.cumsum(inside, 1, dtype=torch.float64)
    last = inner[:, -1:].contiguous()
    pos = torch.minimum(torch.searchsorted(inner, target, right=True), torch.searchsorted(inner, last))
    j = (blk * bs + pos.clamp_(max=bs - 1)).squeeze(1)
    return j.clamp_(max=width - 1), total.squeeze(1)


def _cut_groups(logits, rows, index, candidates, cut, listed):
    """(rows, logits [b, w], token ids [b, w], each row's count of candidates (likeliest first) or None (ids in
    order), the weight outside the candidates [b, 1] or None, rows that must take the row path [b]) for the
    whole rows under a cut (their likeliest tokens) and the rows with allowed-id lists (their ids, -inf
    padded)."""
    device = logits.device
    width = logits.shape[1]
    if cut:
        x = _rows(logits, [index[i] for i in cut])
        opts = [rows[i].options for i in cut]
        ks = [o.top_k if 0 < o.top_k < width else 0 for o in opts]
        wants = [kk or (0 if o.min_p > 0.0 else _NUCLEUS_CANDIDATES) for o, kk in zip(opts, ks)]
        if 0 in wants:
            wants = _min_p_widths(x, opts, wants)
        wants = [min(width, want) for want in wants]
        # One top-k for the group, each row cut back to its own candidates: what a row draws never depends on
        # the widths its neighbours want.
        v, ix = _top(x, max(wants))
        outside = None
        bad = torch.zeros(len(cut), dtype=torch.bool, device=device)
        needs = [r for r, (o, kk) in enumerate(zip(opts, ks)) if kk == 0 and o.top_p < 1.0 and wants[r] < width]
        if needs:
            # A nucleus drawn among the likeliest tokens needs what the others weigh: the row's softmax at its
            # temperature less its candidates' share, in units of the likeliest token's weight (its weight 1).
            at = torch.tensor(needs, device=device)
            temps = torch.tensor([opts[r].temperature for r in needs], dtype=torch.float64, device=device)
            probs = torch.softmax(x.index_select(0, at).div_(temps.to(x.dtype).unsqueeze(1)), 1)
            share = torch.cumsum(probs.gather(1, ix.index_select(0, at)), 1, dtype=torch.float64)
            last = torch.tensor([wants[r] - 1 for r in needs], device=device).unsqueeze(1)
            rest = (1.0 - share.gather(1, last).squeeze(1)) / share[:, 0]
            outside = torch.zeros((len(cut), 1), dtype=torch.float64, device=device)
            outside[at, 0] = torch.where(torch.isfinite(rest), rest, 0.0).clamp_(min=0.0)
            bad[at] = _overflows(v.index_select(0, at)[:, 0], temps)
        yield cut, v, ix, wants, outside, bad
    if listed:
        lens = np.array([len(candidates[i]) for i in listed])
        ids = np.zeros((len(listed), max(lens)), dtype=np.int64)
        pad = np.arange(ids.shape[1]) >= lens[:, None]
        for r, i in enumerate(listed):
            ids[r, :lens[r]] = candidates[i]
            ids[r, lens[r]:] = candidates[i][-1]  # padding: an id of the list, at weight 0 (-inf below)
        flat = ids + np.array([index[i] for i in listed], dtype=np.int64)[:, None] * width  # one gather for all
        v = logits.reshape(-1).index_select(0, torch.from_numpy(flat.reshape(-1)).to(device)).view(ids.shape)
        v = v.masked_fill(torch.from_numpy(pad).to(device), float("-inf"))
        ix = torch.from_numpy(ids).to(device)
        yield listed, v, ix, None, None, torch.zeros(len(listed), dtype=torch.bool, device=device)


def _min_p_widths(x: torch.Tensor, opts: list[SamplingOptions], wants: list[int]) -> list[int]:
    """`wants` with each 0 (a row under min_p, no top_k) replaced by one more than the count of tokens its
    min_p keeps (logits within temperature * ln(min_p) of the peak; rounded to keep more), so that its
    smallest candidate is one min_p cuts; at most `_NUCLEUS_CANDIDATES`: a row keeping more takes the row
    path (whose min_p needs no sort) rather than widen the group's top-k to most of the vocabulary."""
    rows = [r for r, want in enumerate(wants) if want == 0]
    sub = x.index_select(0, torch.tensor(rows, device=x.device)) if len(rows) < x.shape[0] else x
    peak = sub.amax(1, keepdim=True)
    drop = torch.tensor([opts[r].temperature * math.log(opts[r].min_p) for r in rows], dtype=torch.float64,
                        device=x.device).unsqueeze(1)
    cutoff = torch.nextafter((peak.double() + drop).to(x.dtype), torch.full_like(peak, float("-inf")))
    counts = torch.where(torch.isfinite(peak), (sub >= cutoff).sum(1, keepdim=True), 0).squeeze(1).tolist()
    out = list(wants)
    for r, c in zip(rows, counts):
        out[r] = min(c + 1, _NUCLEUS_CANDIDATES)
    return out


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) (largest first) for rows much wider than k: the k largest entries lie in the k blocks
    of `_TOP_BLOCK` columns whose maxima are the largest, so only those blocks are searched."""
    b, width = x.shape
    bs = _TOP_BLOCK
    full = width // bs
    if full < 4 * k or not x.is_contiguous():
        return torch.topk(x, k)
    blocks = torch.topk(x[:, :full * bs].view(b, full, bs).amax(2), k).indices
    cols = (blocks.unsqueeze(2) * bs + torch.arange(bs, device=x.device)).view(b, k * bs)
    if width > full * bs:
        cols = torch.cat([cols, torch.arange(full * bs, width, device=x.device).expand(b, -1)], 1)
    v, at = torch.topk(x.gather(1, cols), k)
    return v, cols.gather(1, at)


def _truncated_weights(v: torch.Tensor, ix: torch.Tensor, opts: list[SamplingOptions], width: int,
                       own: list[int] | None, outside: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' unnormalised float64 weights after temperature, top_k, top_p and min_p, in the order each
    row draws in (likeliest first under top_k, else by token id; `ix` is reordered to match, in place), and
    which rows the weights cannot stand for (a cut reaching past the likeliest tokens a whole row kept).

    `own`: for whole rows (`v` likeliest first), how many columns are each row's candidates; None for
    allowed-id lists (`v` in id order, -inf padded)."""
    sorted_desc = own is not None
    b, n = v.shape
    device = v.device
    col = torch.arange(n, device=device)
    k_list = [o.top_k if 0 < o.top_k < width else 0 for o in opts]
    ks = torch.tensor(k_list, device=device).unsqueeze(1)
    has_k = ks > 0
    if not sorted_desc and any(k_list):
        order = torch.sort(v, dim=1, descending=True, stable=True).indices
        order = torch.where(has_k, order, col)
        v, ix[:] = v.gather(1, order), ix.gather(1, order)
    temps = torch.tensor([o.temperature for o in opts], dtype=torch.float64, device=device).unsqueeze(1)
    peak = v.amax(1, keepdim=True).double()
    broken = ~torch.isfinite(peak)  # NaN, or nothing drawable: the row path's token (see `_overflows`)
    peak = torch.where(broken, 0.0, peak)
    w = torch.exp((v.double() - peak) / temps)
    if sorted_desc:
        lim = torch.tensor(own, device=device).unsqueeze(1)
        w = torch.where(col < lim, w, 0.0)
    elif any(k_list):
        w = torch.where(~has_k | (col < ks), w, 0.0)
    thr = torch.zeros((b, 1), dtype=torch.float64, device=device)
    if any(o.top_p < 1.0 for o in opts):
        ps = torch.tensor([o.top_p for o in opts], dtype=torch.float64, device=device).unsqueeze(1)
        # As `_nucleus`: ascending, the tokens left out are the longest prefix holding at most 1 - top_p of the
        # mass (a whole row's tokens beyond the candidates come first, as `outside`).
        asc = torch.sort(w, 1).values
        cum = torch.cumsum(asc, 1) if outside is None else outside + torch.cumsum(asc, 1)
        first_kept = torch.searchsorted(cum, (1.0 - ps) * cum[:, -1:], right=True).clamp_(max=n - 1)
        thr = torch.where(ps < 1.0, asc.gather(1, first_kept), 0.0)
    if any(o.min_p > 0.0 for o in opts):
        mins = torch.tensor([o.min_p for o in opts], dtype=torch.float64, device=device).unsqueeze(1)
        thr = torch.maximum(thr, mins * w.amax(1, keepdim=True))
    uncovered = broken
    if sorted_desc and not all(k_list) and min(own) < width:
        # A whole row's cut must stay among its likeliest tokens: the smallest of them must be cut (a kept one
        # means the threshold lies beyond them, or ties with tokens that do).
        uncovered = uncovered | (~has_k & (lim < width) & (w.gather(1, lim - 1) >= thr))
    w = torch.where(w >= thr, w, 0.0)
    if sorted_desc and not all(k_list):
        order = torch.where(has_k, col, torch.sort(ix, 1).indices)
        w, ix[:] = w.gather(1, order), ix.gather(1, order)
    return w, uncovered.squeeze(1)


def _emit(group: list[int], keep: list[bool], rows: Sequence[RowSampler], j: torch.Tensor, ix: torch.Tensor | None,
          weights: torch.Tensor, total: torch.Tensor, out: list[int], logprobs: list[RowLogprobs | None]) -> None:
    """Writes the kept rows' tokens (ix[j], or j itself) and, where asked, their logprobs (one sync each)."""
    tokens = (ix.gather(1, j.unsqueeze(1)).squeeze(1) if ix is not None else j).tolist()
    want = [r for r, i in enumerate(group) if keep[r] and rows[i].options.wants_logprobs]
    for r, i in enumerate(group):
        if keep[r]:
            out[i] = tokens[r]
    if not want:
        return
    at = torch.tensor(want, device=weights.device)
    w = weights.index_select(0, at)
    log_total = torch.log(total.index_select(0, at))
    chosen = (torch.log(w.gather(1, j.index_select(0, at).unsqueeze(1)).squeeze(1).double()) - log_total).tolist()
    n = max(rows[group[r]].options.top_logprobs for r in want)
    top_v = top_i = None
    if n:
        top_v, top_at = _top(w, min(n, w.shape[1]))
        top_i = (ix.index_select(0, at).gather(1, top_at) if ix is not None else top_at).tolist()
        top_v = (torch.log(top_v.double()) - log_total.unsqueeze(1)).tolist()
    for k, r in enumerate(want):
        i = group[r]
        m = rows[i].options.top_logprobs
        top = () if not m else tuple((t, v) for t, v in zip(top_i[k][:m], top_v[k][:m]) if v > float("-inf"))
        logprobs[i] = RowLogprobs(chosen[k], top)


def finite_at(logits: torch.Tensor, rows: list[int], cols: list[int]) -> list[bool]:
    """Whether logits[rows[k], cols[k]] is finite, for every k (one gather)."""
    if numpy_fast(logits):
        # Indexing a tensor with Python lists converts them first (docs/benchmarks.md, "Sampling on the CPU");
        # numpy does not.
        return np.isfinite(logits.detach().numpy()[rows, cols]).tolist()
    return torch.isfinite(logits[rows, cols]).tolist()


def _argmax_rows(x: torch.Tensor) -> list[int]:
    if numpy_fast(x):
        return x.detach().numpy().argmax(axis=1).tolist()
    return x.argmax(dim=1).tolist()


def _greedy_logprobs(row: torch.Tensor, pos: int, top_n: int) -> RowLogprobs:
    logp = torch.log_softmax(row.float(), 0)
    return RowLogprobs(float(logp[pos]), tuple(_largest(logp, top_n, float("-inf"))))


def _greedy_logprobs_rows(logits: torch.Tensor, at: list[int], tokens: list[int],
                          top_n: list[int]) -> list[RowLogprobs]:
    """`_greedy_logprobs` of logits[at[k]] at tokens[k] with top_n[k] alternatives, for every k at once."""
    device = logits.device
    logp = torch.log_softmax(logits.index_select(0, torch.tensor(at, device=device)).float(), 1)
    chosen = logp.gather(1, torch.tensor(tokens, device=device).unsqueeze(1)).squeeze(1).tolist()
    n = min(max(top_n), logp.shape[1])
    values = positions = None
    if n:
        best, where = torch.topk(logp, n)
        values, positions = best.tolist(), where.tolist()
    out = []
    for k, m in enumerate(top_n):
        top = () if not m else tuple((p, v) for v, p in zip(values[k][:m], positions[k][:m]) if v > float("-inf"))
        out.append(RowLogprobs(chosen[k], top))
    return out


def _sample_row(row: torch.Tensor, r: RowSampler) -> tuple[int, RowLogprobs | None]:
    opts = r.options
    index = None  # maps positions in `row` back to token ids once top_k has cut it
    if 0 < opts.top_k < row.shape[0]:
        row, index = torch.topk(row, opts.top_k)  # sorted, largest first
    probs = _softmax(row, opts.temperature)
    if opts.top_p < 1.0:
        probs = _nucleus(probs, opts.top_p, is_sorted=index is not None)
    if opts.min_p > 0.0:
        # After top_p, as transformers orders its warpers (vLLM applies min_p before top_k and top_p: the two
        # differ only with top_p set too). The ratio to the likeliest token does not depend on the
        # normalisation, so the nucleus' unnormalised mass serves.
        probs = probs.masked_fill(probs < opts.min_p * probs.max(), 0.0)
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    total = cdf[-1]
    u = torch.rand((), generator=r.generator, dtype=torch.float64, device=cdf.device)
    if not bool(torch.isfinite(total)):
        # Nothing drawable (a NaN logit, or every entry -inf): the position of a logit that is not finite, which
        # the step reports as no token (rather than whatever searchsorted makes of a NaN cdf: past the end, an
        # IndexError under top_k that would send the step's other rows to be drawn again).
        j = int((~torch.isfinite(row)).nonzero()[0, 0])
        return (int(index[j]) if index is not None else j), None
    # The first position whose cdf exceeds u * total has probability > 0, so a masked
    # token is never picked; the clamp (first position reaching total, also > 0) only
    # matters when rounding makes u * total equal total.
    j = int(torch.minimum(
        torch.searchsorted(cdf, u * total, right=True),
        torch.searchsorted(cdf, total),
    ))
    lp = None
    if opts.wants_logprobs:
        # Renormalised over what top_k and top_p left: the distribution j was drawn from.
        log_total = math.log(float(total))
        chosen = math.log(float(probs[j])) - log_total
        top = [(int(index[p]) if index is not None else p, math.log(v) - log_total)
               for p, v in _largest(probs, opts.top_logprobs, 0.0)]
        lp = RowLogprobs(chosen, tuple(top))
    return (int(index[j]) if index is not None else j), lp


def _largest(values: torch.Tensor, n: int, impossible: float) -> list[tuple[int, float]]:
    """Up to n (position, value) pairs, largest value first, leaving out values at `impossible`."""
    if n == 0:
        return []
    best, at = torch.topk(values, min(n, values.shape[0]))
    return [(p, v) for v, p in zip(best.tolist(), at.tolist()) if v > impossible]


def _softmax(row: torch.Tensor, temperature: float) -> torch.Tensor:
    peak = float(row.max())
    if abs(peak) + 1.0 < temperature * _OVERFLOW_GUARD:
        return torch.softmax(row / temperature, 0)
    # row / temperature would overflow to inf (or, below float32's range, divide by zero)
    # and turn the softmax into NaN: shift by the peak and divide in float64 instead.
    return torch.softmax(((row - peak).double() / temperature).float(), 0)


def _nucleus(probs: torch.Tensor, top_p: float, *, is_sorted: bool) -> torch.Tensor:
    """`probs` with everything outside the top_p nucleus zeroed (the top token is always kept)."""
    asc = probs.flip(0) if is_sorted else _sorted_ascending(probs)
    cdf = torch.cumsum(asc, 0, dtype=torch.float64)
    # Ascending, the tokens left out are the longest prefix holding at most 1 - top_p of the
    # mass; the top token stays because the whole mass exceeds that for any top_p > 0.
    # (clamped: a NaN cdf, a row with nothing drawable, answers one past the end)
    first_kept = torch.searchsorted(cdf, (1.0 - top_p) * cdf[-1], right=True).clamp_(max=asc.shape[0] - 1)
    # Thresholding by value (not by rank) keeps every token tied with the smallest one kept.
    return probs.masked_fill(probs < asc[first_kept], 0.0)


def _sorted_ascending(x: torch.Tensor) -> torch.Tensor:
    if numpy_fast(x):
        return torch.from_numpy(np.sort(x.numpy()))
    return torch.sort(x).values


def numpy_fast(x: torch.Tensor) -> bool:
    # numpy's argmax and sort are several times faster than torch's on CPU (the module docstring says where
    # the timings are).
    return x.device.type == "cpu" and x.dtype == torch.float32
