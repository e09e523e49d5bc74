"""Domain errors shared by both services.

Code raises these; `shared.status` is the one place that turns them into gRPC
status codes. Messages are written for the user who sent the request: they
say what was wrong and what to do.

One rule decides which type a refusal is: a request that can never succeed
(malformed, or past a limit it can never pass) is an `InvalidRequestError`
(`RequestTooLargeError` for limits), which no client retries; a request
refused for what is happening now (busy, a replica down) is a
`LimitExceededError` or an `UnavailableError`, which clients retry.
"""


class StructdError(Exception):
    """Base of every error a client may see with its message."""


class InvalidRequestError(StructdError):
    """Malformed or contradictory request fields."""


class InvalidGrammarError(InvalidRequestError):
    """A constraint that does not parse or cannot be satisfied."""


class NoAllowedTokenError(InvalidGrammarError):
    """At some position the constraint allows no token the model can produce (or the model's logits are broken)."""


class GrammarCrashError(InvalidGrammarError):
    """A constraint under which the grammar compiler crashed repeatedly: refused, retrying cannot help."""


class RequestTooLargeError(InvalidRequestError):
    """A limit the request can never pass however often it is retried (spec bytes, JSON nesting depth, schema
    normalisation's work budget, the cap on a compile's time): the message names the limit, and a client that
    retries waits for nothing."""


class LimitExceededError(StructdError):
    """Busy now: a limit on what is in flight (live sessions, compiles waiting, tokenizer slots, queue) that
    frees up as other requests finish: retry later."""


class CompileTimeoutError(StructdError):
    """Compilation outlived its deadline and was stopped.

    ran_seconds: how long the compile itself ran before it was stopped, where known (a queued one ran for
    less than its deadline): what a remembered timeout holds against the grammar."""

    def __init__(self, message: str, ran_seconds: float | None = None):
        super().__init__(message)
        self.ran_seconds = ran_seconds


class UnknownTokenizerError(StructdError):
    """A tokenizer fingerprint this replica was never given."""


class BackendNotInstalledError(StructdError):
    """A request names a grammar backend whose library this replica's image lacks: another replica, or this one
    once the operator installs it, serves it; the message says which library and how to install it."""


class NotFoundError(StructdError):
    """A grammar id or session id this replica does not hold."""


class UnavailableError(StructdError):
    """The service is draining or a dependency is down: retry elsewhere."""


class CancelledError(StructdError):
    """The caller went away or the request was cancelled."""


class CheckTimeoutError(StructdError):
    """Validating an output against its schema outlived its deadline."""


class GrammarDesyncError(StructdError):
    """The grammar tier rejected a token the engine sampled under its own mask: both sides disagree."""


class InternalError(StructdError):
    """A bug, already logged with its traceback and an incident id where it happened; the message names the
    incident (an inference engine core's error on its way to the API server's client)."""
