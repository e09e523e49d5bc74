"""Loopback ports for a process that is told its port before it binds it.

Binding port 0 and closing the socket hands out a port of the kernel's
ephemeral range, which the kernel hands out again to the next port-0 bind or
outgoing connection, sometimes before the process told to use it has bound it
(a grammar replica whose address the inference service started beside it is
given, a tensor-parallel group's rendezvous). Below that range the kernel
never picks a port by itself: a port there is taken only by whoever names it.
So ports are drawn there, at random (independently of the `random` module's
seed), where the range leaves room, checked free by binding them, and never
handed out twice by one process (two draws told to two children would clash).
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

# Below this: the fixed default ports services commonly listen on (ours too: 8000, 9401, 50051 are outside).
FIRST_PORT = 10000
# The kernel's ephemeral range starts here where it cannot be read (IANA's dynamic range).
DEFAULT_EPHEMERAL_LOW = 49152
_draw = random.SystemRandom()
_handed_out: set[int] = set()
_lock = threading.Lock()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux, or no procfs: the platform's, taken as IANA's
        return DEFAULT_EPHEMERAL_LOW


def free_ports(n: int = 1) -> int:
    """The first of n consecutive loopback ports free now and not handed out before by this process: below the
    ephemeral range where it leaves room for them, else where a port-0 bind lands. RuntimeError when none is
    found."""
    low = ephemeral_low()
    # Room for many blocks of n, so random draws rarely meet a taken one; a range starting lower (some containers
    # give the whole space to it) leaves the kernel's picks as the only way.
    below = low - FIRST_PORT > 100 * n
    with _lock:
        for _ in range(200):
            if below:
                base = _draw.randrange(FIRST_PORT, low - n + 1)
            else:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    base = s.getsockname()[1]
                if base + n > 65536:
                    continue
            if _handed_out.intersection(range(base, base + n)):
                continue
            socks = []
            try:
                for port in range(base, base + n):
                    s = socket.socket()
                    socks.append(s)
                    s.bind(("127.0.0.1", port))
            except OSError:  # taken (or in TIME_WAIT): another draw
                continue
            finally:
                for s in socks:
                    s.close()
            _handed_out.update(range(base, base + n))
            return base
    raise RuntimeError(f"no {n} consecutive free loopback ports")


def free_port() -> int:
    """A loopback port free now, below the ephemeral range where there is room (see the module docstring)."""
    return free_ports(1)
