"""structd's OpenAI-compatible HTTP gateway: a third deployable service.

It holds no model: it translates OpenAI's `/v1/chat/completions`,
`/v1/completions`, `/v1/responses` and `/v1/models` (and vLLM's
`/tokenize`, `/detokenize`) into inference.v1 `Generate` / `GetModelInfo`
(/ `Tokenize`, `Detokenize`) calls on the inference service and back, so the SDKs,
gateways and agent frameworks that speak the OpenAI HTTP API can use
structd. It imports only `shared/` (tests/test_import_rules.py) and scales
on its own.
"""
