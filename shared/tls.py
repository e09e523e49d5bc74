"""TLS and mutual TLS for every structd gRPC server and client, from PEM files: the one place credentials are built.

A server (`ServerTls`) serves the certificate and key in its files and, given
a client CA, accepts only clients whose certificate that CA signed. The files
are looked at again on every new connection's handshake (grpc's dynamic
server credentials) and re-read when they changed, as when cert-manager
renews a Secret and the kubelet swaps the mounted files: new connections get
the new certificate while connections already open, and the streams on them,
keep the one they shook hands with. A half-written or mismatched pair is
logged and skipped until the files are whole again; the last good one stays.

A client (`ClientTls`) trusts the CA in its file (none: the system's roots)
and, given a certificate and key, presents them (mutual TLS). Credentials
are read when a channel is made; the long-lived clients (the inference
service's grammar tier, the gateway) watch their files with
`CertificateFiles` and open a new channel for new calls when they change,
leaving the calls on the old one to finish.

A server with a client CA may also name the clients it serves
(`allowed_clients`, `--tls-allowed-clients`: certificate CNs or SANs);
shared/client_identity.py refuses every other certificate from the CA,
call by call, with PERMISSION_DENIED. A client CA removed from the file
stops being trusted for new connections without a restart: the gRPC
servers' configuration is rebuilt from the files, and the gateway's HTTPS
context is replaced, not added to (`SslContextRotation`).

Each command names its flags with a prefix (`--tls`, `--grammar-tls`,
`--target-tls`; the Python client's keyword arguments `tls_`); the problems
found in a configuration name those flags, so the operator reads which one
to fix.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from shared.client_identity import parse_allowed
from shared.flags import FlagSet

log = logging.getLogger(__name__)

# Where a plain HOST:PORT is not the name in the server's certificate (a replica dialled by its pod IP, found
# through a headless Service's name), the channel checks the certificate against this name instead.
TARGET_NAME_OPTION = "grpc.ssl_target_name_override"


def _read(path: Path) -> bytes:
    return path.read_bytes()


def _file_problem(flag: str, path: Path | None) -> str | None:
    if path is not None and not path.is_file():
        return f"{flag} {path}: no such file"
    return None


def _pair_problem(cert_flag: str, cert: Path, key_flag: str, key: Path) -> str | None:
    """Why this certificate and key cannot serve (unreadable, not PEM, the key not the certificate's), or None."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:  # the operator's files
        return f"{cert_flag} {cert} with {key_flag} {key}: not a PEM certificate and its private key ({e})"
    return None


def _ca_problem(flag: str, ca: Path) -> str | None:
    try:
        ssl.create_default_context(cafile=str(ca))
    except (OSError, ssl.SSLError) as e:  # the operator's file
        return f"{flag} {ca}: not a PEM CA certificate ({e})"
    return None


def _name(prefix: str, what: str) -> str:
    """How the caller named a file: --tls + cert: --tls-cert-file; tls_ (keyword arguments) + cert: tls_cert_file."""
    return f"{prefix}{what.replace('-', '_')}_file" if prefix.endswith("_") else f"{prefix}-{what}-file"


def _problems(prefix: str, files: dict[str, Path | None], cert: str, key: str, ca: str) -> list[str]:
    """What is wrong with these files (named by their role: cert, key, ca): missing, unreadable, mismatched."""
    missing = [m for what, path in files.items() if (m := _file_problem(_name(prefix, what), path))]
    if missing:
        return missing
    found = []
    if files[cert] is not None and files[key] is not None:
        found.append(_pair_problem(_name(prefix, cert), files[cert], _name(prefix, key), files[key]))
    if files[ca] is not None:
        found.append(_ca_problem(_name(prefix, ca), files[ca]))
    return [m for m in found if m]


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key, and the CA its clients' certificates must come from (None: any client)."""

    cert_file: Path | None
    key_file: Path | None
    client_ca_file: Path | None = None
    flag_prefix: str = "--tls"  # for messages: --tls-cert-file, --tls-key-file, --tls-client-ca-file
    # Certificate names (CN or SAN) of the clients served; empty: any client certificate the CA signed.
    allowed_clients: tuple[str, ...] = ()

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def problems(self) -> list[str]:
        p = self.flag_prefix
        if self.allowed_clients and self.client_ca_file is None:
            return [f"{p}-allowed-clients names client certificates: it needs {_name(p, 'client-ca')}"]
        if self.cert_file is None or self.key_file is None:
            return [f"{_name(p, 'cert')} and {_name(p, 'key')} go together (the server's certificate and its key)"
                    + (f"; {_name(p, 'client-ca')} needs both" if self.client_ca_file else "")]
        return _problems(p, {"cert": self.cert_file, "key": self.key_file, "client-ca": self.client_ca_file},
                         "cert", "key", "client-ca")

    def files(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p is not None)

    def describe(self) -> str:
        who = f"clients signed by {self.client_ca_file}" if self.mutual else "any client"
        if self.allowed_clients:
            who += f" named {', '.join(self.allowed_clients)}"
        return f"TLS ({self.cert_file}; {who})"


@dataclass(frozen=True)
class ClientTls:
    """What a client trusts (ca_file; None: the system's roots) and the identity it presents (cert + key; None:
    none). server_name: the name the server's certificate must carry where it is not the target's host."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    flag_prefix: str = "--tls"  # for messages: --tls-ca-file, --tls-cert-file, --tls-key-file

    def problems(self) -> list[str]:
        p = self.flag_prefix
        if (self.cert_file is None) != (self.key_file is None):
            return [f"{_name(p, 'cert')} and {_name(p, 'key')} go together (a client certificate and its key)"]
        return _problems(p, {"ca": self.ca_file, "cert": self.cert_file, "key": self.key_file}, "cert", "key", "ca")

    def files(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.ca_file, self.cert_file, self.key_file) if p is not None)

    def with_server_name(self, name: str | None) -> ClientTls:
        return ClientTls(self.ca_file, self.cert_file, self.key_file, name, self.flag_prefix)


def server_tls(cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None,
               flag_prefix: str = "--tls", allowed_clients: tuple[str, ...] = ()) -> ServerTls | None:
    """The server TLS these flags ask for (None: plaintext, when none is given); check its problems()."""
    if cert_file is None and key_file is None and client_ca_file is None and not allowed_clients:
        return None
    return ServerTls(cert_file, key_file, client_ca_file, flag_prefix, allowed_clients)


def client_tls(ca_file: Path | None, cert_file: Path | None, key_file: Path | None,
               flag_prefix: str = "--tls") -> ClientTls | None:
    """The client TLS these flags ask for (None: plaintext, when none is given); check its problems()."""
    if ca_file is None and cert_file is None and key_file is None:
        return None
    return ClientTls(ca_file, cert_file, key_file, flag_prefix=flag_prefix)


def add_server_flags(f: FlagSet, prefix: str = "--tls", what: str = "gRPC") -> None:
    f.add(f"{prefix}-cert-file", None, f"serve {what} over TLS with this PEM certificate (chain); re-read when "
                                       "the file changes", kind=Path)
    f.add(f"{prefix}-key-file", None, f"the PEM private key of {prefix}-cert-file", kind=Path)
    f.add(f"{prefix}-client-ca-file", None, "mutual TLS: require client certificates signed by this PEM CA",
          kind=Path)
    if what != "gRPC":  # the allow-list is checked per gRPC call (client_identity.AllowedClients)
        return
    f.add(f"{prefix}-allowed-clients", "", "mutual TLS: serve only client certificates with one of these names "
                                           "(CN or SAN, comma-separated); others get PERMISSION_DENIED (empty: any "
                                           f"certificate from {prefix}-client-ca-file)")


def add_client_flags(f: FlagSet, prefix: str, peer: str) -> None:
    f.add(f"{prefix}-ca-file", None, f"dial {peer} over TLS, trusting this PEM CA (TLS without it: the system's "
                                     "roots)", kind=Path)
    f.add(f"{prefix}-cert-file", None, f"the PEM client certificate presented to {peer} (mutual TLS)", kind=Path)
    f.add(f"{prefix}-key-file", None, f"the PEM private key of {prefix}-cert-file", kind=Path)


def _path(value: Any) -> Path | None:
    return Path(value) if value else None


def server_tls_from_args(args: Any, prefix: str = "--tls") -> ServerTls | None:
    a = prefix.lstrip("-").replace("-", "_")
    return server_tls(_path(getattr(args, f"{a}_cert_file")), _path(getattr(args, f"{a}_key_file")),
                      _path(getattr(args, f"{a}_client_ca_file")), prefix,
                      parse_allowed(getattr(args, f"{a}_allowed_clients", "") or ""))


def client_tls_from_args(args: Any, prefix: str) -> ClientTls | None:
    a = prefix.lstrip("-").replace("-", "_")
    return client_tls(_path(getattr(args, f"{a}_ca_file")), _path(getattr(args, f"{a}_cert_file")),
                      _path(getattr(args, f"{a}_key_file")), prefix)


# ---------------------------------------------------------------------------------------------- servers


class CertificateFiles:
    """A server's or a client's certificate files, looked at now and then: `changed()` is true once per change
    to a usable set."""

    def __init__(self, tls: ServerTls | ClientTls):
        self.tls = tls
        self._seen = self._signature()

    def _signature(self) -> tuple[bytes, ...]:
        # The contents, not the files' times: a rewrite within one tick of the file system's clock (or a kubelet
        # symlink swap to files of the same size and age) is still a change. A few kB per new connection.
        return tuple(_read(p) for p in self.tls.files())

    def changed(self) -> bool:
        try:
            signature = self._signature()
        except OSError as e:  # the files' owner is mid-swap (or removed them): keep serving the last good ones
            log.warning("TLS: cannot look at the certificate files (%s); keeping the current certificate", e)
            return False
        if signature == self._seen:
            return False
        # Remembered before checking: a broken pair is reported once, and looked at again when it changes.
        self._seen = signature
        if problems := self.tls.problems():
            log.warning("TLS: the changed certificate files are not usable (%s); keeping the current certificate",
                        "; ".join(problems))
            return False
        return True

    def load_failed(self, error: Exception) -> None:
        """The files changed again between changed() and their loading: the next look loads them."""
        self._seen = ()
        log.warning("TLS: cannot load the changed certificate files (%s); keeping the current certificate", error)

    def loaded(self) -> None:
        log.info("TLS: certificate files changed; new connections use %s", self.tls.cert_file or self.tls.files()[0])


class _RotatingCertificates:
    """grpc's certificate configuration fetcher: a new configuration when the files changed, else None."""

    def __init__(self, tls: ServerTls):
        self.tls = tls
        self.files = CertificateFiles(tls)
        self.initial = self._configuration()

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        t = self.tls
        return grpc.ssl_server_certificate_configuration(
            [(_read(t.key_file), _read(t.cert_file))], _read(t.client_ca_file) if t.client_ca_file else None)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        if not self.files.changed():
            return None
        try:
            configuration = self._configuration()
        except OSError as e:
            self.files.load_failed(e)
            return None
        self.files.loaded()
        return configuration


def server_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """Credentials for `add_secure_port`, re-reading the files when they change (see the module's docstring)."""
    fetch = _RotatingCertificates(tls)
    return grpc.dynamic_ssl_server_credentials(fetch.initial, fetch, require_client_authentication=tls.mutual)


def server_ssl_context(tls: ServerTls) -> ssl.SSLContext:
    """An ssl server context (the gateway's HTTPS) for these files; keep it current with SslContextRotation."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file is not None:
        ctx.load_verify_locations(cafile=str(tls.client_ca_file))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class SslContextRotation:
    """Serves changed certificate files from a live ssl server context: connections accepted after `check()`
    get the new certificate and trust only the new client CA, open ones keep theirs. Call check() now and then
    (the gateway: every few seconds).

    An SSLContext only ever adds trusted CAs (load_verify_locations
    appends), so a changed set of files becomes a fresh context, and the
    served one's SNI callback, which runs in every handshake before the
    client's certificate is asked for, hands each new connection the
    freshest context.
    """

    def __init__(self, ctx: ssl.SSLContext, tls: ServerTls):
        self.ctx = ctx
        self.tls = tls
        self.files = CertificateFiles(tls)
        self.current = ctx
        ctx.sni_callback = self._use_current

    def _use_current(self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None,
                     ctx: ssl.SSLContext) -> None:
        if self.current is not ctx:
            connection.context = self.current

    def check(self) -> bool:
        """True when the files changed and were loaded; a broken or half-swapped pair is logged and kept out."""
        if not self.files.changed():
            return False
        try:
            fresh = server_ssl_context(self.tls)
        except (OSError, ssl.SSLError) as e:
            self.files.load_failed(e)
            return False
        self.current = fresh
        self.files.loaded()
        return True


# ---------------------------------------------------------------------------------------------- clients


def channel_credentials(tls: ClientTls) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file) if tls.ca_file else None,
        private_key=_read(tls.key_file) if tls.key_file else None,
        certificate_chain=_read(tls.cert_file) if tls.cert_file else None)


def _options(options: tuple, tls: ClientTls | None) -> tuple:
    if tls is not None and tls.server_name:
        return (*options, (TARGET_NAME_OPTION, tls.server_name))
    return options


def aio_channel(target: str, tls: ClientTls | None, options: tuple = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to target: over TLS when tls is given, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, channel_credentials(tls), options=_options(options, tls))


def sync_channel(target: str, tls: ClientTls | None, options: tuple = ()) -> grpc.Channel:
    """A blocking channel to target: over TLS when tls is given, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, channel_credentials(tls), options=_options(options, tls))
