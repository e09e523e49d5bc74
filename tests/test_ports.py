"""shared/ports.py: ports handed to a process before it binds them are drawn below the kernel's ephemeral range,
where no port-0 bind or outgoing connection takes them in the meantime."""

from __future__ import annotations

import random
import socket

import pytest

from shared import ports


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("n", [pytest.param(1, id="one"), pytest.param(3, id="three-consecutive")])
def test_ports_are_free_and_below_the_ephemeral_range(n):
    low = ports.ephemeral_low()
    for _ in range(20):
        base = ports.free_ports(n)
        assert ports.FIRST_PORT <= base and base + n <= low
        assert all(_bindable(p) for p in range(base, base + n))


def test_a_port_taken_is_never_handed_out(monkeypatch):
    """Draws land on a port somebody holds: it is passed over for the next draw."""
    free = ports.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken, taken, free])
        monkeypatch.setattr(ports._draw, "randrange", lambda a, b: next(draws))
        assert ports.free_port() == free


def test_a_seeded_random_module_does_not_repeat_the_draws():
    """Two test workers that seed `random` alike must not draw the same ports."""
    random.seed(7)
    first = [ports.free_port() for _ in range(5)]
    random.seed(7)
    assert [ports.free_port() for _ in range(5)] != first


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.FIRST_PORT + 50)
    port = ports.free_port()
    assert port >= ports.FIRST_PORT + 50 and _bindable(port)
