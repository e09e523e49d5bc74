"""shared/codec.py: token-mask wire codec round trips, size choice, malformed input.

Property-based over random id sets at every density (hypothesis), checked
against a plain-Python LEB128 reference, then over real masks that xgrammar
fills while walking valid instances of a few constraints with the real
129,280-token tokenizer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shared.codec import (
    ALLOWED,
    CACHED,
    DENSE,
    DISALLOWED,
    MAX_VOCAB_SIZE,
    SAME_AS,
    EncodedMask,
    MaskDecodeError,
    MaskDecoder,
    MaskEncoder,
    StreamMaskCache,
    allowed_ids,
    FilledRow,
    assign_wire_forms,
    decode_ids,
    encode_ids,
    words_for_vocab,
)

REAL_VOCAB = 129_280
# Vocabulary sizes at and around word boundaries, plus the real one.
VOCABS = [1, 2, 31, 32, 33, 63, 100, 1000, 4097, REAL_VOCAB]
DENSITIES = [1e-5, 1e-4, 1e-3, 0.01, 0.05, 0.12, 0.125, 0.13, 0.3, 0.5, 0.7, 0.87, 0.875, 0.88, 0.95,
             0.99, 0.999, 0.9999]

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- references


def ref_encode(ids) -> bytes:
    """Plain-Python delta-coded LEB128, straight from the proto comment."""
    out = bytearray()
    prev = -1
    for i in ids:
        v = int(i) - prev - 1
        assert v >= 0
        while True:
            byte = v & 0x7F
            v >>= 7
            out.append(byte | (0x80 if v else 0))
            if not v:
                break
        prev = int(i)
    return bytes(out)


def ref_decode(data: bytes, vocab: int) -> list[int] | None:
    """Plain-Python inverse of ref_encode; None where the input is malformed
    (truncated, a delta of more than 3 bytes, an id outside the vocabulary)."""
    ids, prev, value, shift, length = [], -1, 0, 0, 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        shift += 7
        length += 1
        if length > 3:
            return None
        if not byte & 0x80:
            prev = prev + value + 1
            ids.append(prev)
            value, shift, length = 0, 0, 0
    if length or (ids and ids[-1] >= vocab):
        return None
    return ids


def row_from_ids(ids: np.ndarray, vocab: int, extra_words: int = 0) -> np.ndarray:
    """xgrammar's layout: int32 words, bit id%32 of word id//32."""
    row = np.zeros(words_for_vocab(vocab) + extra_words, dtype=np.uint32)
    ids = np.asarray(ids, dtype=np.int64)
    np.bitwise_or.at(row, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return row.view(np.int32)


def ids_from_row(row: np.ndarray, vocab: int) -> np.ndarray:
    """Independent of the codec: one Python bit test per id."""
    words = np.asarray(row).view(np.uint32)
    return np.array([i for i in range(vocab) if (int(words[i >> 5]) >> (i & 31)) & 1], dtype=np.int64)


def padding_mask(vocab: int) -> int:
    """Bits of the last word that lie past the vocabulary."""
    tail = vocab % 32
    return 0 if tail == 0 else (0xFFFFFFFF & ~((1 << tail) - 1))


# ---------------------------------------------------------------- strategies


@st.composite
def id_sets(draw, vocab=None):
    """(vocab_size, sorted unique ids) at every density from empty to full."""
    if vocab is None:
        vocab = draw(st.one_of(st.sampled_from(VOCABS), st.integers(1, 5000)))
    shape = draw(st.sampled_from(["empty", "one", "all", "all_but_one", "random", "runs", "explicit", "edge"]))
    if shape == "empty":
        ids = np.empty(0, dtype=np.int64)
    elif shape == "one":
        ids = np.array([draw(st.integers(0, vocab - 1))], dtype=np.int64)
    elif shape == "all":
        ids = np.arange(vocab, dtype=np.int64)
    elif shape == "all_but_one":
        gone = draw(st.integers(0, vocab - 1))
        ids = np.delete(np.arange(vocab, dtype=np.int64), gone)
    elif shape == "random":
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        ids = np.flatnonzero(rng.random(vocab) < draw(st.sampled_from(DENSITIES))).astype(np.int64)
    elif shape == "runs":
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        keep = np.zeros(vocab, dtype=bool)
        for _ in range(draw(st.integers(1, 8))):
            a = int(rng.integers(0, vocab))
            keep[a:a + int(rng.integers(1, max(2, vocab // 4)))] = True
        ids = np.flatnonzero(keep).astype(np.int64)
    elif shape == "edge":
        ids = edge_ids(vocab, draw(st.integers(-3, 3)), draw(st.integers(0, 4)), draw(st.integers(0, 2**32 - 1)))
        if draw(st.booleans()):
            ids = np.setdiff1d(np.arange(vocab, dtype=np.int64), ids, assume_unique=True)
    else:
        ids = np.array(sorted(draw(st.sets(st.integers(0, vocab - 1), max_size=200))), dtype=np.int64)
    return vocab, ids


def edge_ids(vocab: int, offset: int, big_gaps: int, seed: int) -> np.ndarray:
    """About as many ids as the dense form has bytes, a few of them after gaps of
    128+ (2-byte deltas): where list and dense sizes cross."""
    count = min(max(0, words_for_vocab(vocab) * 4 + offset), vocab)
    big_gaps = min(big_gaps, (vocab - count) // 128, count)
    rng = np.random.default_rng(seed)
    gaps = np.zeros(count, dtype=np.int64)
    gaps[rng.choice(count, size=big_gaps, replace=False)] = 128
    ids = np.cumsum(gaps + 1) - 1
    return ids + int(rng.integers(0, vocab - ids[-1])) if count else ids


# ---------------------------------------------------------------- id lists


@SETTINGS
@given(id_sets())
@example((REAL_VOCAB, np.array([0, 127, 128, 255, 16_511, 16_512, REAL_VOCAB - 1])))
@example((MAX_VOCAB_SIZE, np.array([MAX_VOCAB_SIZE - 1])))  # largest delta: three full groups
@example((1, np.array([0])))
def test_encode_ids_round_trip_matches_reference(case):
    vocab, ids = case
    data = encode_ids(ids)
    assert data == ref_encode(ids)
    back = decode_ids(data, vocab)
    assert back.dtype == np.int64
    np.testing.assert_array_equal(back, ids)


def test_encode_ids_delta_byte_lengths():
    # 0..127 -> 1 byte, 128..16383 -> 2, 16384..2**21-1 -> 3.
    assert encode_ids(np.array([0])) == b"\x00"
    assert encode_ids(np.array([127])) == b"\x7f"
    assert encode_ids(np.array([128])) == b"\x80\x01"
    assert encode_ids(np.array([16_383])) == b"\xff\x7f"
    assert encode_ids(np.array([16_384])) == b"\x80\x80\x01"
    assert encode_ids(np.array([0, 1, 2])) == b"\x00\x00\x00"
    assert encode_ids(np.array([], dtype=np.int64)) == b""


@SETTINGS
@given(st.binary(max_size=64), st.sampled_from([1, 33, 100, REAL_VOCAB]))
@example(b"\x80\x00", 1)  # an overlong (non-minimal) varint still reads as its value
@example(b"\xff\xff\x7f", MAX_VOCAB_SIZE)
def test_decode_ids_arbitrary_bytes_is_error_or_valid_list(data, vocab):
    """Any byte string decodes exactly as the reference does, or raises MaskDecodeError where it is malformed."""
    want = ref_decode(data, vocab)
    if want is None:
        with pytest.raises(MaskDecodeError):
            decode_ids(data, vocab)
        return
    ids = decode_ids(data, vocab)
    assert ids.tolist() == want
    assert ids.size == 0 or (ids[0] >= 0 and ids[-1] < vocab)
    assert np.all(np.diff(ids) > 0)


# ---------------------------------------------------------------- rows


@SETTINGS
@given(id_sets(), st.booleans())
@example((REAL_VOCAB, np.empty(0, dtype=np.int64)), False)
@example((REAL_VOCAB, np.arange(REAL_VOCAB)), False)
@example((33, np.arange(33)), True)
@example((100, np.array([99])), True)
# 127 ids (< 128 dense bytes) but two 2-byte deltas: the list is 129 bytes, dense wins.
@example((1000, np.concatenate([[128, 257], np.arange(258, 383)])), False)
@example((1000, np.setdiff1d(np.arange(1000), np.concatenate([[128, 257], np.arange(258, 383)]))), False)
def test_encode_row_round_trip_and_smallest(case, dirty_padding):
    vocab, ids = case
    enc, dec = MaskEncoder(vocab), MaskDecoder(vocab)
    row = row_from_ids(ids, vocab)
    sent = row.copy()
    if dirty_padding and padding_mask(vocab):
        # Bits past the vocabulary are padding: never allowed, never "disallowed".
        sent.view(np.uint32)[-1] |= np.uint32(padding_mask(vocab))
    before = sent.copy()
    got = enc.encode_row(sent)
    np.testing.assert_array_equal(sent, before)  # the input row is not modified

    out = np.full(enc.num_words, -1, dtype=np.int32)
    dec.decode_into(got.field, got.value, out, [])
    np.testing.assert_array_equal(out, row)
    np.testing.assert_array_equal(allowed_ids(out, vocab), ids)

    # The chosen encoding is the smallest of the three self-contained ones.
    disallowed = np.setdiff1d(np.arange(vocab, dtype=np.int64), ids, assume_unique=True)
    sizes = {DENSE: words_for_vocab(vocab) * 4, ALLOWED: len(ref_encode(ids)),
             DISALLOWED: len(ref_encode(disallowed))}
    assert got.field in sizes
    assert got.wire_bytes == sizes[got.field] == min(sizes.values()), (got.field, sizes)
    if got.field == ALLOWED:
        assert got.value == ref_encode(ids)
    elif got.field == DISALLOWED:
        assert got.value == ref_encode(disallowed)
    else:
        assert got.value == row.tobytes()


@pytest.mark.parametrize(
    "vocab, ids, field",
    [
        pytest.param(REAL_VOCAB, [], ALLOWED, id="empty-129280-allowed"),
        pytest.param(REAL_VOCAB, [42], ALLOWED, id="one-id-allowed"),
        pytest.param(REAL_VOCAB, "all", DISALLOWED, id="all-ids-disallowed-list"),
        pytest.param(REAL_VOCAB, "half", DENSE, id="half-dense"),
        pytest.param(33, "all", DISALLOWED, id="all-33-disallowed-list"),
        pytest.param(1, [0], DISALLOWED, id="vocab-1-all"),
        pytest.param(1, [], ALLOWED, id="vocab-1-none"),
    ],
)
def test_encode_row_expected_encoding(vocab, ids, field):
    if ids == "all":
        ids = np.arange(vocab)
    elif ids == "half":
        ids = np.arange(0, vocab, 2)
    ids = np.asarray(ids, dtype=np.int64)
    row = row_from_ids(ids, vocab)
    got = MaskEncoder(vocab).encode_row(row)
    assert got.field == field
    out = np.full(words_for_vocab(vocab), -1, dtype=np.int32)
    MaskDecoder(vocab).decode_into(got.field, got.value, out, [])
    np.testing.assert_array_equal(out, row)


def test_decode_ids_id_beyond_vocab_uses_validated_vocab():
    np.testing.assert_array_equal(decode_ids(encode_ids(np.array([99])), 100), [99])
    with pytest.raises(MaskDecodeError, match="outside vocabulary"):
        decode_ids(encode_ids(np.array([100])), 100)


# ---------------------------------------------------------------- batches and same_as


@st.composite
def batches(draw):
    vocab = draw(st.sampled_from([33, 100, 4097, REAL_VOCAB]))
    distinct = draw(st.lists(id_sets(vocab=vocab), min_size=1, max_size=4))
    order = draw(st.lists(st.integers(0, len(distinct) - 1), min_size=1, max_size=12))
    rows = np.stack([row_from_ids(distinct[k][1], vocab) for k in order])
    return vocab, rows


@SETTINGS
@given(batches())
def test_encode_batch_same_as_references_and_round_trip(case):
    vocab, rows = case
    encoded = MaskEncoder(vocab).encode_batch(rows)
    assert len(encoded) == len(rows)
    first: dict[bytes, int] = {}
    for i, (row, enc) in enumerate(zip(rows, encoded)):
        j = first.setdefault(row.tobytes(), i)
        if j == i:
            assert enc.field != SAME_AS
        else:
            # A repeated row is a reference to the first identical row.
            assert enc == EncodedMask(SAME_AS, j) and enc.wire_bytes == 4

    dec = MaskDecoder(vocab)
    out = np.full_like(rows, -1)
    done: list[np.ndarray | None] = []
    for i, enc in enumerate(encoded):
        dec.decode_into(enc.field, enc.value, out[i], done)
        done.append(out[i])
    np.testing.assert_array_equal(out, rows)


@SETTINGS
@given(id_sets(), st.integers(1, 40))
def test_decode_into_wider_row_clears_padding_words(case, extra):
    """A model vocabulary larger than the tokenizer's: words past num_words are disallowed."""
    vocab, ids = case
    enc = MaskEncoder(vocab).encode_row(row_from_ids(ids, vocab))
    out = np.full(words_for_vocab(vocab) + extra, -1, dtype=np.int32)
    MaskDecoder(vocab).decode_into(enc.field, enc.value, out, [])
    np.testing.assert_array_equal(out, row_from_ids(ids, vocab, extra_words=extra))
    assert not out[words_for_vocab(vocab):].any()
    np.testing.assert_array_equal(ids_from_row(out, vocab + 32 * extra), ids)


def test_same_as_copies_into_wider_row():
    vocab = 100
    a = row_from_ids(np.array([1, 50, 99]), vocab)
    prior = np.concatenate([a, np.zeros(2, dtype=np.int32)])
    out = np.full(words_for_vocab(vocab) + 2, -1, dtype=np.int32)
    MaskDecoder(vocab).decode_into(SAME_AS, 0, out, [prior])
    np.testing.assert_array_equal(out, prior)


# ---------------------------------------------------------------- stream mask cache


@st.composite
def streams(draw):
    """(vocab, cache slots, messages): each message a batch of rows from a small pool,
    so rows recur within and across messages."""
    vocab = draw(st.sampled_from([100, 4097, REAL_VOCAB]))
    pool = draw(st.lists(id_sets(vocab=vocab), min_size=1, max_size=6))
    slots = draw(st.integers(1, 8))
    messages = draw(st.lists(st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=6), min_size=1, max_size=8))
    rows = [row_from_ids(ids, vocab) for _, ids in pool]
    return vocab, slots, [np.stack([rows[k] for k in m]) for m in messages]


def _server_side(enc: MaskEncoder, cache: StreamMaskCache, rows: np.ndarray) -> list[EncodedMask]:
    """What the stepper does: rows the client has cached at fill time are not encoded
    (None); assign_wire_forms decides the final form in result order."""
    items = []
    for i, r in enumerate(rows):
        key = enc.canonical(r).tobytes()
        items.append(FilledRow(i, key, None if cache.lookup(key) is not None else enc.encode_row(r), enc))
    return assign_wire_forms(items, cache)


@SETTINGS
@given(streams())
def test_stream_mask_cache_round_trip(case):
    vocab, slots, messages = case
    enc, cache, dec = MaskEncoder(vocab), StreamMaskCache(slots), MaskDecoder(vocab, slots)
    sent_before: set[bytes] = set()  # rows the client received in an earlier message
    for rows in messages:
        wire = _server_side(enc, cache, rows)
        out = np.full_like(rows, -1)
        done: list[np.ndarray | None] = []
        for i, w in enumerate(wire):
            dec.decode_into(w.field, w.value, out[i], done, w.store_slot)
            done.append(out[i])
        np.testing.assert_array_equal(out, rows)
        for r, w in zip(rows, wire):
            if w.field == CACHED:
                assert r.tobytes() in sent_before
            if w.store_slot is not None:
                # Only masks worth keeping take a slot.
                assert w.wire_bytes > StreamMaskCache.MIN_BYTES and 0 <= w.store_slot < slots
        sent_before.update(r.tobytes() for r in rows)


@SETTINGS
@given(streams(), st.booleans())
def test_sparse_forms_describe_the_decoded_rows(case, write_sparse_rows):
    """Every SparseMask the decoder hands out (direct, same_as or cached) allows exactly the row's tokens;
    rows without one are decoded right even when rows with one are left unwritten."""
    vocab, slots, messages = case
    enc, cache = MaskEncoder(vocab), StreamMaskCache(slots)
    dec = MaskDecoder(vocab, slots, write_sparse_rows=write_sparse_rows)
    for rows in messages:
        wire = _server_side(enc, cache, rows)
        out = np.zeros_like(rows)
        done: list[np.ndarray | None] = []
        forms: list = []
        for i, w in enumerate(wire):
            forms.append(dec.decode_into(w.field, w.value, out[i], done, w.store_slot, forms))
            done.append(out[i])
        for row, got, w, form in zip(rows, out, wire, forms):
            allowed = allowed_ids(row, vocab)
            if form is None:
                assert w.field in (DENSE, SAME_AS, CACHED)
                np.testing.assert_array_equal(got, row)
                continue
            if write_sparse_rows:
                np.testing.assert_array_equal(got, row)
            expected = allowed if form.allow else np.setdiff1d(np.arange(vocab), allowed, assume_unique=True)
            np.testing.assert_array_equal(form.ids, expected)


@SETTINGS
@given(streams())
def test_stream_mask_cache_with_room_resends_nothing_large(case):
    """With a slot for every distinct mask, a large mask crosses the wire once per stream."""
    vocab, _, messages = case
    distinct = {r.tobytes() for rows in messages for r in rows}
    enc = MaskEncoder(vocab)
    cache, dec = StreamMaskCache(len(distinct)), MaskDecoder(vocab, len(distinct))
    shipped: set[bytes] = set()
    for rows in messages:
        wire = _server_side(enc, cache, rows)
        out = np.zeros_like(rows)
        done: list[np.ndarray | None] = []
        for i, w in enumerate(wire):
            dec.decode_into(w.field, w.value, out[i], done, w.store_slot)
            done.append(out[i])
            if w.field not in (CACHED, SAME_AS) and w.wire_bytes > StreamMaskCache.MIN_BYTES:
                key = rows[i].tobytes()
                assert key not in shipped, "a cached mask was sent again"
                shipped.add(key)
        np.testing.assert_array_equal(out, rows)


def test_stream_mask_cache_recycles_slots_round_robin():
    vocab = 1000
    enc = MaskEncoder(vocab)
    cache, dec = StreamMaskCache(2), MaskDecoder(vocab, 2)
    a, b, c = (row_from_ids(np.arange(k, vocab, 3), vocab) for k in range(3))  # three dense masks

    def send(*rows):
        batch = np.stack(rows)
        wire = _server_side(enc, cache, batch)
        out = np.zeros_like(batch)
        done = []
        for i, w in enumerate(wire):
            dec.decode_into(w.field, w.value, out[i], done, w.store_slot)
            done.append(out[i])
        np.testing.assert_array_equal(out, batch)
        return [(w.field, w.value if w.field in (CACHED, SAME_AS) else None, w.store_slot) for w in wire]

    assert send(a, b, a) == [(DENSE, None, 0), (DENSE, None, 1), (SAME_AS, 0, None)]
    assert send(b, a) == [(CACHED, 1, None), (CACHED, 0, None)]
    # c takes slot 0 (a's); a then needs sending again, into slot 1 (b's).
    assert send(c, a) == [(DENSE, None, 0), (DENSE, None, 1)]
    assert send(a, c, b) == [(CACHED, 1, None), (CACHED, 0, None), (DENSE, None, 0)]


def test_small_masks_are_not_cached():
    vocab = REAL_VOCAB
    enc = MaskEncoder(vocab)
    cache = StreamMaskCache(4)
    row = row_from_ids(np.array([5, 9]), vocab)  # a 2-byte allowed list
    for _ in range(3):
        (w,) = _server_side(enc, cache, row[None, :])
        assert w.field == ALLOWED and w.store_slot is None


# ---------------------------------------------------------------- malformed input


def _full_row(vocab):
    return row_from_ids(np.arange(vocab), vocab)


@pytest.mark.parametrize(
    "vocab, field, value, prior, match",
    [
        pytest.param(100, ALLOWED, b"\x85", [], "truncated varint", id="truncated-varint-one-byte"),
        pytest.param(100, DISALLOWED, b"\x01\x02\x80", [], "truncated varint", id="truncated-varint-at-end"),
        pytest.param(REAL_VOCAB, ALLOWED, b"\x80\x80\x80\x01", [], "longer than 3 bytes", id="varint-four-bytes"),
        pytest.param(100, ALLOWED, encode_ids(np.array([3, 100])), [], "outside vocabulary", id="allowed-id-beyond-vocab"),
        pytest.param(33, DISALLOWED, encode_ids(np.array([33])), [], "outside vocabulary", id="disallowed-id-beyond-vocab"),
        pytest.param(REAL_VOCAB, ALLOWED, encode_ids(np.array([REAL_VOCAB + 5000])), [], "outside vocabulary",
                     id="id-beyond-real-vocab"),
        pytest.param(100, DENSE, b"\x00" * 12, [], "dense mask has 12 bytes", id="dense-too-short"),
        pytest.param(100, DENSE, b"\x00" * 20, [], "dense mask has 20 bytes", id="dense-too-long"),
        pytest.param(REAL_VOCAB, DENSE, b"", [], "dense mask has 0 bytes", id="dense-empty"),
        pytest.param(100, SAME_AS, 0, [], "same_as_index 0", id="same-as-no-earlier-rows"),
        pytest.param(100, SAME_AS, 1, [_full_row(100)], "same_as_index 1", id="same-as-forward-reference"),
        pytest.param(100, SAME_AS, 0, [None], "same_as_index 0", id="same-as-row-without-mask"),
        pytest.param(100, None, b"", [], "no encoding", id="no-encoding-set"),
    ],
)
def test_malformed_masks_raise(vocab, field, value, prior, match):
    out = np.zeros(words_for_vocab(vocab), dtype=np.int32)
    with pytest.raises(MaskDecodeError, match=match):
        MaskDecoder(vocab).decode_into(field, value, out, prior)


@pytest.mark.parametrize(
    "slots, field, value, store_slot, match",
    [
        pytest.param(0, CACHED, 0, None, "cached_slot 0 is outside", id="cached-slot-without-cache"),
        pytest.param(4, CACHED, 4, None, "cached_slot 4 is outside", id="cached-slot-out-of-range"),
        pytest.param(0, ALLOWED, b"\x01", 0, "store_slot 0 is outside", id="store-slot-without-cache"),
        pytest.param(4, DENSE, b"\x00" * 16, 7, "store_slot 7 is outside", id="store-slot-out-of-range"),
    ],
)
def test_malformed_cache_references_raise(slots, field, value, store_slot, match):
    vocab = 100
    out = np.zeros(words_for_vocab(vocab), dtype=np.int32)
    with pytest.raises(MaskDecodeError, match=match):
        MaskDecoder(vocab, slots).decode_into(field, value, out, [], store_slot)


@pytest.mark.parametrize("vocab", [pytest.param(0, id="zero"), pytest.param(MAX_VOCAB_SIZE + 1, id="too-large")])
def test_vocab_size_bounds(vocab):
    with pytest.raises(ValueError):
        MaskEncoder(vocab)
    with pytest.raises(ValueError):
        MaskDecoder(vocab)


# ---------------------------------------------------------------- real masks


REAL_CASES = [
    pytest.param(
        "json_schema",
        {"type": "object",
         "properties": {"name": {"type": "string", "maxLength": 12},
                        "age": {"type": "integer", "minimum": 0},
                        "tags": {"type": "array", "items": {"enum": ["a", "b", "ünï"]}},
                        "ok": {"type": "boolean"}},
         "required": ["name", "age", "tags", "ok"], "additionalProperties": False},
        ['{"name":"Ada Lovelace","age":36,"tags":["a","ünï"],"ok":true}',
         '{"name":"","age":0,"tags":[],"ok":false}'],
        {ALLOWED, DISALLOWED, DENSE},
        id="json-schema-object"),
    pytest.param(
        "json_schema",
        {"type": "array", "items": {"type": "number"}, "minItems": 1},
        ['[1.5,-2,3e10,0.25]'],
        {ALLOWED},
        id="json-schema-numbers"),
    pytest.param("regex", r"[0-9]{3}-[0-9]{4}( ext\. [0-9]+)?", ["555-1234", "555-1234 ext. 99"], {ALLOWED}, id="regex-phone"),
    pytest.param("json", None, ['{"a":[1,{"b":null}],"c":"x\\ny"}'], {ALLOWED, DISALLOWED}, id="builtin-json"),
]


@pytest.fixture(scope="module")
def compiler(xgr_tokenizer_info):
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr_tokenizer_info, max_threads=2)


def _compile(compiler, kind, spec):
    if kind == "json_schema":
        return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
    if kind == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_builtin_json_grammar()


@pytest.mark.parametrize("kind, spec, instances, expect_fields", REAL_CASES)
def test_real_masks_round_trip(compiler, hf_tokenizer, xgr_tokenizer_info, kind, spec, instances, expect_fields):
    """Walk valid instances token by token; every xgrammar mask survives encode/decode exactly."""
    import xgrammar as xgr

    vocab = xgr_tokenizer_info.vocab_size
    assert vocab == REAL_VOCAB
    enc, dec = MaskEncoder(vocab), MaskDecoder(vocab)
    compiled = _compile(compiler, kind, spec)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    stop = xgr_tokenizer_info.stop_token_ids[0]
    fields = set()
    for text in instances:
        tokens = hf_tokenizer.encode(text, add_special_tokens=False)
        matcher = xgr.GrammarMatcher(compiled)
        rows = []
        for pos in range(len(tokens) + 1):
            matcher.fill_next_token_bitmask(bitmask)
            row = bitmask[0].numpy().copy()
            rows.append(row)
            got = enc.encode_row(row)
            fields.add(got.field)
            out = np.full(enc.num_words + 3, -1, dtype=np.int32)
            dec.decode_into(got.field, got.value, out, [])
            np.testing.assert_array_equal(out[: enc.num_words], row, err_msg=f"{text!r} at token {pos}")
            assert not out[enc.num_words:].any()
            want = tokens[pos] if pos < len(tokens) else stop
            assert (int(out.view(np.uint32)[want >> 5]) >> (want & 31)) & 1, f"{text!r}: token {pos} not allowed"
            if pos < len(tokens):
                assert matcher.accept_token(tokens[pos])
        # The whole walk as one batch: repeated masks become references and still decode.
        batch = np.stack(rows)
        encoded = enc.encode_batch(batch)
        out = np.zeros_like(batch)
        done = []
        for i, e in enumerate(encoded):
            dec.decode_into(e.field, e.value, out[i], done)
            done.append(out[i])
        np.testing.assert_array_equal(out, batch)
    # Real walks exercise more than one encoding.
    # The walk exercised the encodings it should (e.g. free text inside a
    # string needs the disallowed list or dense words, structure the allowed list).
    assert expect_fields <= fields, fields


def test_decoder_remembers_id_lists_and_stays_bounded():
    """An id list that comes back is not decoded again (the same SparseMask); a bad one raises every
    time; the memo never holds more than DECODE_MEMO_ENTRIES lists, nor lists past DECODE_MEMO_MAX_BYTES."""
    from shared.codec import DECODE_MEMO_ENTRIES, DECODE_MEMO_MAX_BYTES, encode_ids

    vocab = 129_280
    dec = MaskDecoder(vocab)
    row = np.zeros(dec.num_words, dtype=np.int32)
    value = encode_ids(np.array([3, 70, 4000]))
    first = dec.decode_into(ALLOWED, value, row, [])
    again = dec.decode_into(ALLOWED, value, row, [])
    assert again is first and first.allow and first.ids.tolist() == [3, 70, 4000]
    # The same bytes as a disallowed list are another mask.
    assert dec.decode_into(DISALLOWED, value, row, []).allow is False
    bad = encode_ids(np.array([vocab + 5]))
    for _ in range(2):
        with pytest.raises(MaskDecodeError):
            dec.decode_into(ALLOWED, bad, row, [])
    for k in range(DECODE_MEMO_ENTRIES + 10):
        dec.decode_into(ALLOWED, encode_ids(np.array([k, k + 1])), row, [])
        assert len(dec._memo) <= DECODE_MEMO_ENTRIES
    long_list = encode_ids(np.arange(0, 4 * DECODE_MEMO_MAX_BYTES, 2))
    assert len(long_list) > DECODE_MEMO_MAX_BYTES
    a, b = (dec.decode_into(ALLOWED, long_list, row, []) for _ in range(2))
    assert a is not b and np.array_equal(a.ids, b.ids)
