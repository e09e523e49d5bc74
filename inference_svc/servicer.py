"""inference.v1.InferenceService: protobuf <-> engine translation only."""

from __future__ import annotations

from inference_svc.config import EngineConfig
from inference_svc.engine import Engine
from inference_svc.grammar_session import Constraint
from inference_svc.request import FinishReason, Output
from inference_svc.sampling import SamplingOptions
from shared import errors
from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.status import abort

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


def constraint(c: pb.Constraint) -> Constraint | None:
    """The engine's constraint for a client's (None: unconstrained)."""
    kind = c.WhichOneof("kind")
    if kind is None:
        return None
    if kind in ("json_schema", "regex", "ebnf", "structural_tag") and not getattr(c, kind).strip():
        raise errors.InvalidRequestError(f"constraint.{kind} is empty")
    if kind == "choice":
        if not c.choice.choices:
            raise errors.InvalidRequestError("constraint.choice needs at least one choice")
        return Constraint("choice", choices=tuple(c.choice.choices))
    if kind == "json_object":
        return Constraint("json_object") if c.json_object else None  # json_object=false asks for nothing
    return Constraint(kind, getattr(c, kind))


def sampling_options(s: pb.SamplingParams, config: EngineConfig, max_model_len: int) -> SamplingOptions:
    return SamplingOptions.validated(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop=tuple(s.stop), ignore_eos=s.ignore_eos,
        default_max_tokens=config.default_max_tokens, max_max_tokens=max_model_len)


def response(out: Output) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(token_ids=out.token_ids, text=out.text)
    if out.finish_reason is not None:
        resp.finish_reason = _FINISH[out.finish_reason]
        u = out.usage
        resp.usage.prompt_tokens = u.prompt_tokens
        resp.usage.completion_tokens = u.completion_tokens
        resp.usage.forced_tokens = u.forced_tokens
    return resp


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    async def Generate(self, request: pb.GenerateRequest, context):
        engine = self.engine
        try:
            options = sampling_options(request.sampling, engine.config, engine.max_model_len)
            spec = constraint(request.constraint)
            req = await engine.submit(request.prompt, options, spec,
                                      jump_forward=not request.constraint.disable_jump_forward,
                                      request_id=request.request_id)
        except Exception as e:  # noqa: BLE001 - mapped to a status by the one table
            await abort(context, e)
            return
        try:
            while True:
                out = await req.outputs.get()
                if out.error is not None:
                    await abort(context, out.error)
                    return
                yield response(out)
                if out.finish_reason is not None:
                    return
        finally:
            # The client cancelled, its deadline passed, or the stream broke: free KV and grammar state.
            engine.cancel(req)

