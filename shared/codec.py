"""Token-mask wire codec: packed bitmask rows <-> grammar.v1.TokenMask.

A mask row is xgrammar's layout: ceil(V/32) int32 words, bit (id % 32) of
word (id // 32) set when token id is allowed. On the wire each row goes as
the smallest of: the dense words, the allowed ids, the disallowed ids (both
as delta-coded LEB128 varints), or a reference to an identical row earlier in
the same message. Everything here is vectorised numpy, because it runs on
every row of every step on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Three 7-bit groups cover every id below 2**21; larger vocabularies are
# rejected rather than silently mis-coded.
MAX_VOCAB_SIZE = 1 << 21

DENSE = "dense_words"
ALLOWED = "allowed_ids_varint"
DISALLOWED = "disallowed_ids_varint"
SAME_AS = "same_as_index"
CACHED = "cached_slot"


class MaskDecodeError(ValueError):
    """A TokenMask that cannot be a valid mask for this vocabulary."""


def words_for_vocab(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def encode_ids(ids: np.ndarray) -> bytes:
    """Sorted, strictly increasing ids -> delta-coded LEB128 bytes."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return b""
    v = np.diff(ids, prepend=-1) - 1
    nbytes = 1 + (v >= 1 << 7).astype(np.int64) + (v >= 1 << 14)
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    out[starts] = (v & 0x7F) | ((nbytes > 1) << 7)
    two = nbytes >= 2
    out[starts[two] + 1] = ((v[two] >> 7) & 0x7F) | ((nbytes[two] > 2) << 7)
    three = nbytes == 3
    out[starts[three] + 2] = (v[three] >> 14) & 0x7F
    return out.tobytes()


def decode_ids(data: bytes, vocab_size: int) -> np.ndarray:
    """Inverse of encode_ids, validated against vocab_size."""
    if not data:
        return np.empty(0, dtype=np.int64)
    b = np.frombuffer(data, dtype=np.uint8)
    if b[-1] & 0x80:
        raise MaskDecodeError("truncated varint in token id list")
    ends = np.flatnonzero(b < 0x80)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if lengths.max() > 3:
        raise MaskDecodeError("token id delta longer than 3 bytes")
    v = (b[starts] & 0x7F).astype(np.int64)
    two = lengths >= 2
    v[two] |= (b[starts[two] + 1] & 0x7F).astype(np.int64) << 7
    three = lengths == 3
    v[three] |= (b[starts[three] + 2] & 0x7F).astype(np.int64) << 14
    ids = np.cumsum(v + 1) - 1
    if ids[-1] >= vocab_size:
        raise MaskDecodeError(f"token id {int(ids[-1])} outside vocabulary of {vocab_size}")
    return ids


def _bits_to_ids(words: np.ndarray) -> np.ndarray:
    """Set bit positions of a uint32 word array, looking only at non-zero words."""
    # Scanning 64-bit words halves the work of the scan that dominates.
    if words.shape[0] % 2 == 0:
        nz64 = np.flatnonzero(words.view(np.uint64))
        nz = np.empty(nz64.size * 2, dtype=np.int64)
        nz[0::2] = nz64 * 2
        nz[1::2] = nz64 * 2 + 1
    else:
        nz = np.flatnonzero(words)
    if nz.size == 0:
        return np.empty(0, dtype=np.int64)
    bits = np.unpackbits(words[nz].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    rows, cols = np.nonzero(bits)
    return nz[rows] * 32 + cols


@dataclass(frozen=True)
class EncodedMask:
    """One row's wire form: (oneof field name, value), and the cache slot to store it in."""

    field: str
    value: bytes | int
    store_slot: int | None = None

    @property
    def wire_bytes(self) -> int:
        return len(self.value) if isinstance(self.value, bytes) else 4


class MaskEncoder:
    """Encodes rows of a packed bitmask for one vocabulary size."""

    def __init__(self, vocab_size: int):
        if not 0 < vocab_size <= MAX_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be in 1..{MAX_VOCAB_SIZE}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.num_words = words_for_vocab(vocab_size)
        # Bits past vocab_size in the last word are padding: never "allowed",
        # never counted as "disallowed".
        valid = np.full(self.num_words, 0xFFFFFFFF, dtype=np.uint32)
        tail = vocab_size % 32
        if tail:
            valid[-1] = (1 << tail) - 1
        self.valid = valid
        self.padding = bool(tail)  # the last word has bits past vocab_size
        self.dense_bytes = self.num_words * 4

    def canonical(self, row: np.ndarray) -> np.ndarray:
        """The row as uint32 words with padding bits cleared (what is compared and cached)."""
        return row.view(np.uint32)[: self.num_words] & self.valid

    def encode_row(self, row: np.ndarray) -> EncodedMask:
        """The smallest self-contained encoding of one row (int32 or uint32 words)."""
        words = self.canonical(row)
        allowed = int(np.bitwise_count(words).sum(dtype=np.int64))
        disallowed = self.vocab_size - allowed
        # A varint list costs at least one byte per id: skip the list work
        # when even that would not beat the dense words.
        if min(allowed, disallowed) < self.dense_bytes:
            if allowed <= disallowed:
                enc = EncodedMask(ALLOWED, encode_ids(_bits_to_ids(words)))
            else:
                enc = EncodedMask(DISALLOWED, encode_ids(_bits_to_ids(words ^ self.valid)))
            if enc.wire_bytes < self.dense_bytes:
                return enc
        return EncodedMask(DENSE, words.tobytes())

    def encode_batch(self, bitmask: np.ndarray) -> list[EncodedMask]:
        """Encodes each row of an (n, num_words) array; repeated rows become references."""
        rows = np.ascontiguousarray(bitmask)
        return assign_wire_forms(
            [FilledRow(i, self.canonical(r).tobytes(), self.encode_row(r), self) for i, r in enumerate(rows)], None)


class StreamMaskCache:
    """Server side of a stream's mask cache: which row sits in which client slot.

    Slots are reused round-robin; the client mirrors every store_slot, so
    both sides agree on each slot's content without further messages.
    """

    # Masks this small are cheaper to resend than to keep.
    MIN_BYTES = 16

    def __init__(self, slots: int):
        self.slots = slots
        self._slot_of: dict[bytes, int] = {}
        self._key_in: list[bytes | None] = [None] * slots
        self._next = 0

    def lookup(self, key: bytes) -> int | None:
        return self._slot_of.get(key)

    def store(self, key: bytes) -> int:
        slot = self._next
        self._next = (slot + 1) % self.slots
        old = self._key_in[slot]
        if old is not None:
            del self._slot_of[old]
        self._key_in[slot] = key
        self._slot_of[key] = slot
        return slot


@dataclass(slots=True)
class FilledRow:
    """One filled mask on its way to the wire."""

    index: int  # the result it belongs to, in the step
    key: bytes  # the canonical row's bytes: equal masks, equal keys
    encoding: EncodedMask | None  # None: not encoded (the client has it cached, or it repeats an earlier row)
    encoder: MaskEncoder
    fill_seconds: float = 0.0


def assign_wire_forms(rows: list[FilledRow], cache: StreamMaskCache | None) -> list[EncodedMask]:
    """Final wire form of each filled row, in result order.

    A row equal to an earlier row of the message becomes a same_as reference,
    one the client has cached becomes a cached_slot, and a new one large
    enough is stored in the next cache slot. An encoding of None (the filler
    skipped it because the row was cached, or repeats an earlier row of the
    message) is computed here if that slot was recycled in the meantime.
    """
    out: list[EncodedMask] = []
    first: dict[bytes, int] = {}
    for row in rows:
        index, key, enc = row.index, row.key, row.encoding
        j = first.setdefault(key, index)
        if j != index:
            out.append(EncodedMask(SAME_AS, j))
            continue
        slot = cache.lookup(key) if cache is not None else None
        if slot is not None:
            out.append(EncodedMask(CACHED, slot))
            continue
        if enc is None:
            enc = row.encoder.encode_row(np.frombuffer(key, dtype=np.uint32))
        if cache is not None and enc.wire_bytes > StreamMaskCache.MIN_BYTES:
            enc = EncodedMask(enc.field, enc.value, cache.store(key))
        out.append(enc)
    return out


@dataclass(frozen=True)
class SparseMask:
    """A mask as the id list it came as: only `ids` allowed (allow=True), or all but `ids`.

    Where logits live on the CPU, writing -inf at a few thousand ids is far
    cheaper than expanding 129k bits per row, so the decoder also hands out
    this form for every mask that arrived (or was cached, or referenced) as a list.
    """

    allow: bool
    ids: np.ndarray  # sorted int64 token ids, all below the tokenizer's vocab size


# Id lists a decoder remembers by their wire bytes (the same lists come back step after step: every
# JSON string interior, every separator); lists longer than DECODE_MEMO_MAX_BYTES are decoded each time.
DECODE_MEMO_ENTRIES = 1024
DECODE_MEMO_MAX_BYTES = 4096


class MaskDecoder:
    """Decodes wire masks straight into rows of a preallocated int32 bitmask.

    Holds the client side of the stream mask cache, so use one decoder per
    step stream. Id lists it has decoded recently are not decoded again:
    decoding is a dozen numpy calls a row, a lookup far less (docs/benchmarks.md,
    "Host path at simulated steps", item 3).
    The SparseMasks it returns may therefore be shared between rows and
    steps: their ids must not be modified.
    """

    def __init__(self, vocab_size: int, cache_slots: int = 0, *, write_sparse_rows: bool = True):
        """write_sparse_rows=False: a mask with a SparseMask form leaves its row unwritten (a caller that
        applies every such mask from its id list, as the engine does on the CPU, saves setting its bits)."""
        self.vocab_size = vocab_size
        self.num_words = words_for_vocab(vocab_size)
        self._valid = MaskEncoder(vocab_size).valid
        self.write_sparse_rows = write_sparse_rows
        self.cache_slots = cache_slots
        self._cache = np.zeros((cache_slots, self.num_words), dtype=np.uint32) if cache_slots else None
        self._sparse: list[SparseMask | None] = [None] * cache_slots
        self._memo: dict[tuple[bool, bytes], SparseMask] = {}

    def decode_into(self, field: str, value, out_row: np.ndarray, rows_so_far: list[np.ndarray | None],
                    store_slot: int | None = None,
                    sparse_so_far: list[SparseMask | None] | None = None) -> SparseMask | None:
        """Writes one mask into out_row (int32, at least num_words long); returns its SparseMask, if any.

        rows_so_far holds the rows already decoded from the same message, in
        result order (None for results without a mask), for same_as
        references; sparse_so_far, when given, the SparseMasks returned for
        them. Words past num_words (a model vocabulary larger than the
        tokenizer's) are cleared: disallowed.
        """
        sparse = None
        row = out_row.view(np.uint32)
        if row.shape[0] > self.num_words:
            row[self.num_words:] = 0
            row = row[: self.num_words]
        if field == DENSE:
            if len(value) != self.num_words * 4:
                raise MaskDecodeError(f"dense mask has {len(value)} bytes, expected {self.num_words * 4}")
            np.bitwise_and(np.frombuffer(value, dtype=np.uint32), self._valid, out=row)
        elif field == ALLOWED:
            sparse = self._id_list(True, value)
            if self.write_sparse_rows:
                row[:] = 0
                self._set_bits(row, sparse.ids, 1)
        elif field == DISALLOWED:
            sparse = self._id_list(False, value)
            if self.write_sparse_rows:
                row[:] = self._valid
                self._set_bits(row, sparse.ids, 0)
        elif field == SAME_AS:
            if not 0 <= value < len(rows_so_far) or rows_so_far[value] is None:
                raise MaskDecodeError(f"same_as_index {value} does not name an earlier mask")
            if sparse_so_far is not None and value < len(sparse_so_far):
                sparse = sparse_so_far[value]
            if self.write_sparse_rows or sparse is None:
                row[:] = rows_so_far[value].view(np.uint32)[: self.num_words]
        elif field == CACHED:
            if not 0 <= value < self.cache_slots:
                raise MaskDecodeError(f"cached_slot {value} is outside this stream's {self.cache_slots} slots")
            sparse = self._sparse[value]
            if self.write_sparse_rows or sparse is None:
                row[:] = self._cache[value]
        else:
            raise MaskDecodeError(f"mask has no encoding set ({field!r})")
        if store_slot is not None:
            if not 0 <= store_slot < self.cache_slots:
                raise MaskDecodeError(f"store_slot {store_slot} is outside this stream's {self.cache_slots} slots")
            if self.write_sparse_rows or sparse is None:
                self._cache[store_slot] = row
            self._sparse[store_slot] = sparse
        return sparse

    def _id_list(self, allow: bool, value: bytes) -> SparseMask:
        """The SparseMask of an allowed/disallowed id list, remembered by its wire bytes."""
        if len(value) > DECODE_MEMO_MAX_BYTES:
            return SparseMask(allow, decode_ids(value, self.vocab_size))
        key = (allow, value)
        sparse = self._memo.get(key)
        if sparse is None:
            # Decoded (and validated) before it is remembered: a bad list raises every time it comes.
            sparse = SparseMask(allow, decode_ids(value, self.vocab_size))
            if len(self._memo) >= DECODE_MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = sparse
        return sparse

    @staticmethod
    def _set_bits(row: np.ndarray, ids: np.ndarray, value: int) -> None:
        if ids.size == 0:
            return
        word = ids >> 5
        bit = np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))
        if value:
            np.bitwise_or.at(row, word, bit)
        else:
            np.bitwise_and.at(row, word, ~bit)


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Allowed token ids of one packed row (tests, debugging)."""
    enc = MaskEncoder(vocab_size)
    return _bits_to_ids(enc.canonical(np.ascontiguousarray(row)))
