"""The compile worker process: compiles one spec at a time with xgrammar.

It runs in its own process so that a compile that outlives its deadline can
be killed outright (xgrammar cannot be interrupted from Python). It returns
the compiled grammar serialized, plus every warning: xgrammar's own, which it
prints on stderr, captured here, and the schema scanner's.

Messages on the pipe (parent -> worker):
  ("tokenizer", fingerprint, info_json)
  ("compile", fingerprint, GrammarSpec, ship_above_seconds)
Replies (worker -> parent):
  ("ok", serialized_json or None, warnings, duration_seconds, memory_bytes)
      serialized_json is None when the compile took at most ship_above_seconds
      (the parent recompiles in-process rather than pay for serialization), or
      when serializing it ran out of the worker's address space (the JSON is
      many times the grammar: docs/benchmarks.md, "Hostile input at the
      grammar service"): the compile itself fit, so the parent compiles it too
  ("invalid", message)      the spec is malformed or unsatisfiable
  ("too_large", message)    the spec is past a limit it can never pass (schema normalisation's budget)
  ("memory", message)       the compile ran out of the worker's address space (--worker-memory-limit-bytes)
  ("error", message)        anything else (a bug or an xgrammar crash)

A worker's address space is capped (RLIMIT_AS, `--memory-limit BYTES`,
0: no cap) before it reads its first message, so a spec whose compile
grows without bound costs that compile, never the replica's memory. A
worker that answered "memory" is replaced (its heap may be in any state).

The same module is also the workers' zygote (`--zygote FD`): a process that
has imported xgrammar once and forks a ready worker per request, in
milliseconds instead of the seconds (far more on a loaded machine) that a fresh
interpreter needs to import xgrammar and torch (docs/benchmarks.md, "Compile
workers"). On its SOCK_SEQPACKET socket
the server sends b"fork" with one end of a new socketpair (SCM_RIGHTS); the
zygote answers the child's pid as ASCII with a pidfd for it, or b"error:..."
without one. The pidfd lets the server watch and kill a process that is not
its child, with no risk of hitting a reused pid. The zygote ignores SIGCHLD,
so the kernel reaps the workers it forked.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import tempfile
import time

from shared.errors import InvalidGrammarError, RequestTooLargeError
from shared.xgrammar_messages import clean_message

MEMORY_LIMIT_FLAG = "--memory-limit"


def limit_address_space(limit_bytes: int) -> None:
    """Caps this process's virtual address space (RLIMIT_AS); 0 leaves it as it is."""
    if limit_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


class _StderrCapture:
    """Redirects fd 2 (where xgrammar's C++ logging writes) into a temp file."""

    def __init__(self):
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)

    def __enter__(self):
        self._file.seek(0)
        self._file.truncate()
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)

    def lines(self) -> list[str]:
        self._file.seek(0)
        return self._file.read().decode("utf-8", "replace").splitlines()


def _warnings_from(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if "Warning:" in line:
            msg = line.split("Warning:", 1)[1].strip()
            if msg and msg not in out:
                out.append(msg)
    return out


def _out_of_memory(e: BaseException) -> bool:
    """Python's MemoryError, or xgrammar's C++ std::bad_alloc (which reaches Python as a RuntimeError)."""
    return isinstance(e, MemoryError) or "bad_alloc" in str(e)


def _serialized(compiled) -> str | None:
    """The compiled grammar as JSON, or None where that needs more than the worker's address space."""
    try:
        return compiled.serialize_json()
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        return None


def serve(conn) -> None:
    import xgrammar as xgr

    from grammar_svc.compile.spec import compile_spec
    from grammar_svc.schema import schema_warnings
    from grammar_svc.schema.json_grammar import normalised_schema_text
    from grammar_svc.types import Kind

    compilers: dict[str, object] = {}
    capture = _StderrCapture()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "tokenizer":
            _, fp, info_json = msg
            info = xgr.TokenizerInfo.deserialize_json(info_json)
            # One thread per worker: parallelism comes from the worker count,
            # and a killed worker then stops exactly one core's worth of work.
            compilers[fp] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            conn.send(("ok",))
            continue
        _, fp, spec, ship_above_seconds = msg
        try:
            start = time.perf_counter()
            with capture:
                compiled = compile_spec(compilers[fp], spec)
            duration = time.perf_counter() - start
            warnings = _warnings_from(capture.lines())
            if spec.kind is Kind.JSON_SCHEMA:
                warnings += schema_warnings.scan(json.loads(spec.text),
                                                 json.loads(normalised_schema_text(spec.text, for_xgrammar=True)))
            # A fast compile is cheaper to redo in the server than to serialize.
            serialized = _serialized(compiled) if duration > ship_above_seconds else None
            conn.send(("ok", serialized, warnings, duration, compiled.memory_size_bytes))
        except RequestTooLargeError as e:
            conn.send(("too_large", str(e)))
        except InvalidGrammarError as e:  # the schema's (normalisation found it matches nothing)
            conn.send(("invalid", str(e)))
        except (MemoryError, RuntimeError, ValueError, TypeError, xgr.InvalidJSONError,
                xgr.InvalidStructuralTagError) as e:
            if _out_of_memory(e):
                conn.send(("memory", clean_message(str(e)) or type(e).__name__))
                return  # its heap may be in any state: the pool replaces it
            conn.send(("invalid", clean_message(str(e))))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
            conn.send(("error", f"{type(e).__name__}: {e}"))


def zygote(sock, memory_limit_bytes: int = 0) -> None:
    """Forks a worker per b"fork" request (see the module docstring) until the server hangs up; each worker's
    address space capped at memory_limit_bytes (0: not capped)."""
    import signal
    import socket
    from multiprocessing.connection import Connection

    # Everything a worker needs, imported once here and shared copy-on-write by every fork.
    import xgrammar  # noqa: F401
    from grammar_svc.compile import spec  # noqa: F401
    from grammar_svc.schema import schema_warnings  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    sock.send(b"ready")
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
        except (EOFError, OSError):  # the server's end closed: it is gone, and so are we
            return
        if not msg:
            return
        if msg != b"fork" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            sock.send(b"error:bad request")
            continue
        (fd,) = fds
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sock.close()
                limit_address_space(memory_limit_bytes)
                conn = Connection(fd)
                conn.send(("ready",))
                serve(conn)
            except BaseException:  # noqa: BLE001 - the forked worker's own end; never fall back into the zygote loop
                status = 1
            finally:
                os._exit(status)
        os.close(fd)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as e:  # the kernel's answer: no pidfds here (old kernel, seccomp), or the child is gone
            if e.errno != errno.ESRCH:
                os.kill(pid, signal.SIGKILL)  # a worker the server cannot watch must not live on
            sock.send(f"error:pidfd_open: {e}".encode())
            continue
        socket.send_fds(sock, [str(pid).encode()], [pidfd])
        os.close(pidfd)


def main() -> None:
    """Entry point: `python -m grammar_svc.compile.compile_worker FD` (FD: one end of a socketpair),
    or `python -m grammar_svc.compile.compile_worker --zygote FD` (FD: a SOCK_SEQPACKET socket); either
    may end with `--memory-limit BYTES`, each worker's address-space cap."""
    import sys
    from multiprocessing.connection import Connection

    args = sys.argv[1:]
    memory_limit = 0
    if MEMORY_LIMIT_FLAG in args:
        at = args.index(MEMORY_LIMIT_FLAG)
        memory_limit = int(args[at + 1])
        del args[at:at + 2]
    if args[0] == "--zygote":
        import socket

        try:
            zygote(socket.socket(fileno=int(args[1])), memory_limit)
        except KeyboardInterrupt:
            pass
        return
    conn = Connection(int(args[0]))
    import xgrammar  # noqa: F401 - loaded before "ready" so the first compile is not slowed by imports

    limit_address_space(memory_limit)  # after the imports, which map what they map once

    conn.send(("ready",))
    try:
        serve(conn)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
