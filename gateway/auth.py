"""API keys (`--api-key`, `--api-key-file`): who may call the gateway, and which key a request came with.

A request sends its key as the OpenAI SDKs do, `Authorization: Bearer KEY`.
Each presented key is hashed and its digest compared with every configured
key's digest by `hmac.compare_digest`, all of them every time, so neither
which key matched nor how much of a wrong key was right shows in the time
the answer takes (comparing digests of one length also hides the keys'
lengths). A missing or wrong key gets 401 in OpenAI's error shape with
`WWW-Authenticate: Bearer`.

/health and /metrics stay open, as in vLLM: probes and Prometheus scrape
them without a key, and they tell nothing about the model or its prompts;
everything else (the OpenAI routes, /tokenize, /detokenize and any unknown
path) needs one. A CORS preflight never carries the key and is answered by
the CORS middleware, which sits outside this one.

A key's identity is a fingerprint, "key-" and the first hex digits of its
SHA-256: not the key, yet stable across restarts and replicas, so logs and
per-client limits can name the caller (the gateway sends it to the inference
service as the request's end client).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import ApiError

# Paths served without a key: probes and scrapes (docs/openai.md, "API keys").
OPEN_PATHS = frozenset({"/health", "/metrics"})
# Hex digits of a key's SHA-256 that name it: enough to tell an operator's keys apart, far too few to find one.
FINGERPRINT_HEX = 8
# Where the request's key identity is kept for the handlers (an ASGI scope key).
SCOPE_KEY = "structd.api_key_identity"


class ApiKeyFileError(ValueError):
    """An --api-key-file that cannot be used (the operator's configuration)."""


def read_key_file(path: Path) -> tuple[str, ...]:
    """The keys in a file: one a line; blank lines and lines starting with # are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ApiKeyFileError(f"--api-key-file {path}: cannot read it: {e}") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ApiKeyFileError(f"--api-key-file {path}: holds no key (one a line)")
    return keys


def key_problems(keys: Iterable[str]) -> list[str]:
    """Why these keys cannot be served (a key that no header could carry)."""
    problems = []
    for i, key in enumerate(keys):
        if not key or key != key.strip() or any(c.isspace() for c in key):
            problems.append(f"API key #{i + 1} is empty or holds whitespace (an Authorization header cannot carry it)")
        elif not key.isascii() or not key.isprintable():
            problems.append(f"API key #{i + 1} holds characters other than printable ASCII")
    return problems


def fingerprint(key: str) -> str:
    """A key's identity: "key-" and the first hex digits of its SHA-256 (never the key itself)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:FINGERPRINT_HEX]


class ApiKeys:
    """The configured keys, kept as digests only; `identity` says whose a presented key is."""

    def __init__(self, keys: Iterable[str]):
        self._digests = [(hashlib.sha256(k.encode()).digest(), fingerprint(k)) for k in dict.fromkeys(keys)]
        if not self._digests:
            raise ValueError("ApiKeys needs at least one key")

    def __len__(self) -> int:
        return len(self._digests)

    def identity(self, presented: str | None) -> str | None:
        """The presented key's identity, None when it is none of the keys; every key is compared, whatever
        matched, so the time taken does not depend on which."""
        if presented is None:
            return None
        digest = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        found = None
        for known, name in self._digests:
            if hmac.compare_digest(digest, known):
                found = name
        return found


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (the scheme's case ignored, as RFC 7235 says)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header using "
           "Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
WRONG = "Incorrect API key provided. Ask the operator of this structd gateway for a key (--api-key)."


class ApiKeyMiddleware:
    """ASGI middleware: HTTP requests outside OPEN_PATHS need one of the keys; the key's identity is put in the
    scope (SCOPE_KEY) for the handlers."""

    def __init__(self, app: ASGIApp, keys: ApiKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        identity = self.keys.identity(token)
        if identity is None:
            await _unauthorized(send, MISSING if token is None else WRONG)
            return
        scope[SCOPE_KEY] = identity
        await self.app(scope, receive, send)


async def _unauthorized(send: Send, message: str) -> None:
    body = json.dumps(ApiError(401, message, "invalid_request_error", None, "invalid_api_key").body()).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b'Bearer realm="structd"')]})
    await send({"type": "http.response.body", "body": body})


def key_identity(scope: Scope) -> str:
    """The identity of the key the request came with ("" when the gateway takes no keys)."""
    return scope.get(SCOPE_KEY, "")
