"""Asyncio client for the grammar service (used by the inference service, tests and benchmarks)."""

from __future__ import annotations

import asyncio
from typing import Sequence

import grpc
import numpy as np

from shared.client_identity import END_CLIENT_METADATA
from shared.codec import MaskDecoder, SparseMask
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.gen.grammar.v1 import grammar_service_pb2_grpc as pb_grpc
from shared.grpc_options import CHANNEL_OPTIONS
from shared.tls import ClientTls, aio_channel
from shared.tokenizer import TokenizerDescription

# 256 slots hold 4 MB of masks at 129k tokens: enough for the masks that recur
# (string interiors, separators) across a batch.
DEFAULT_MASK_CACHE_SLOTS = 256
# A channel left behind by renew() gives the calls still on it this long before it is closed: longer than the
# longest compile a replica allows by default (--max-compile-timeout-seconds).
RETIRED_CHANNEL_GRACE_SECONDS = 120.0


class StepStream:
    """One bidirectional step stream. write() and read() may be split to overlap work.

    With mask_cache_slots > 0 the server may send masks as references to
    masks it asked this client to keep: decode every response of the stream,
    in order, with `self.decoder` (one per stream).
    """

    def __init__(self, call, vocab_size: int, mask_cache_slots: int, write_sparse_rows: bool = True):
        self._call = call
        self._next_step_id = 0
        self.mask_cache_slots = mask_cache_slots
        self.decoder = MaskDecoder(vocab_size, mask_cache_slots, write_sparse_rows=write_sparse_rows)

    async def write(self, sessions: Sequence[pb.SessionStep]) -> int:
        self._next_step_id += 1
        req = pb.StepRequest(step_id=self._next_step_id, sessions=sessions)
        if self._next_step_id == 1:
            req.mask_cache_slots = self.mask_cache_slots
        await self._call.write(req)
        return self._next_step_id

    async def read(self) -> pb.StepResponse:
        resp = await self._call.read()
        if resp is grpc.aio.EOF:
            raise ConnectionError("grammar step stream ended")
        return resp

    async def step(self, sessions: Sequence[pb.SessionStep]) -> pb.StepResponse:
        await self.write(sessions)
        return await self.read()

    async def close(self) -> None:
        await self._call.done_writing()

    def cancel(self) -> None:
        self._call.cancel()


class GrammarClient:
    def __init__(self, target: str, channel: grpc.aio.Channel | None = None, tls: ClientTls | None = None):
        """tls: dial over TLS (mutual with a client certificate); None: plaintext. Ignored with a channel."""
        self.target = target
        self.channel = channel or aio_channel(target, tls, CHANNEL_OPTIONS)
        self.stub = pb_grpc.GrammarServiceStub(self.channel)
        # Channels renew() replaced: the streams and calls opened on them go on until close_retired().
        self._retired: list[grpc.aio.Channel] = []

    def renew(self, tls: ClientTls | None) -> None:
        """New calls and streams go over a new channel with these credentials (a rotated client certificate);
        those already open stay on the old channel until close_retired()."""
        self._retired.append(self.channel)
        self.channel = aio_channel(self.target, tls, CHANNEL_OPTIONS)
        self.stub = pb_grpc.GrammarServiceStub(self.channel)

    @property
    def has_retired_channels(self) -> bool:
        return bool(self._retired)

    async def close_retired(self) -> None:
        """Closes the channels renew() replaced, giving calls still on them a grace period to finish."""
        retired, self._retired = self._retired, []
        await asyncio.gather(*(c.close(RETIRED_CHANNEL_GRACE_SECONDS) for c in retired))

    async def register_tokenizer(self, desc: TokenizerDescription, timeout: float = 60.0) -> pb.RegisterTokenizerResponse:
        """Sends the tokenizer only when the replica does not know its fingerprint yet."""
        try:
            return await self.stub.RegisterTokenizer(
                pb.RegisterTokenizerRequest(tokenizer_fingerprint=desc.fingerprint), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        return await self.stub.RegisterTokenizer(
            pb.RegisterTokenizerRequest(tokenizer_fingerprint=desc.fingerprint,
                                        tokenizer_info_json_zlib=desc.compressed_info(),
                                        hf_tokenizer_json_zlib=desc.compressed_hf()),
            timeout=timeout)

    async def compile(self, fingerprint: str, spec: pb.GrammarSpec, timeout_seconds: float = 0.0,
                      rpc_timeout: float | None = None, end_client: str = "",
                      backend: int = pb.GRAMMAR_BACKEND_UNSPECIFIED) -> pb.CompileResponse:
        """end_client: who the compile is for (client_identity.END_CLIENT_METADATA), counted apart by the
        replica's per-caller limit when this client presents a certificate. backend: the grammar library
        (unspecified: the replica's --grammar-backend)."""
        metadata = ((END_CLIENT_METADATA, end_client),) if end_client else None
        return await self.stub.Compile(
            pb.CompileRequest(tokenizer_fingerprint=fingerprint, spec=spec, timeout_seconds=timeout_seconds,
                              backend=backend),
            timeout=rpc_timeout, metadata=metadata)

    async def check_output(self, grammar_id: str, token_ids: Sequence[int],
                           rpc_timeout: float | None = None) -> pb.CheckOutputResponse:
        return await self.stub.CheckOutput(pb.CheckOutputRequest(grammar_id=grammar_id, token_ids=token_ids),
                                           timeout=rpc_timeout)

    def open_stream(self, vocab_size: int, mask_cache_slots: int = DEFAULT_MASK_CACHE_SLOTS,
                    write_sparse_rows: bool = True) -> StepStream:
        """A step stream; write_sparse_rows=False: see MaskDecoder (the caller applies id lists itself)."""
        return StepStream(self.stub.Step(), vocab_size, mask_cache_slots, write_sparse_rows)

    async def close(self) -> None:
        retired, self._retired = self._retired, []
        await asyncio.gather(self.channel.close(), *(c.close() for c in retired))


def decode_masks(resp: pb.StepResponse, decoder: MaskDecoder, bitmask: np.ndarray,
                 rows: Sequence[int] | None = None, sparse: list[SparseMask | None] | None = None) -> list[int]:
    """Decodes every mask of a step response into bitmask rows (rows[i] for result i;
    default i). Returns the indices of the results that carried a mask. With a
    `sparse` list, appends each result's SparseMask (None: dense or no mask)."""
    decoded: list[np.ndarray | None] = []
    forms: list[SparseMask | None] = [] if sparse is None else sparse
    with_mask = []
    for i, r in enumerate(resp.results):
        field = r.mask.WhichOneof("encoding")
        if field is None:
            decoded.append(None)
            forms.append(None)
            continue
        row = bitmask[rows[i] if rows is not None else i]
        store = r.mask.store_slot if r.mask.HasField("store_slot") else None
        forms.append(decoder.decode_into(field, getattr(r.mask, field), row, decoded, store, forms))
        decoded.append(row)
        with_mask.append(i)
    return with_mask
