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


ROOM = ports.ephemeral_low() - ports.FIRST_PORT > 300
needs_room = pytest.mark.skipif(not ROOM, reason="this host's ephemeral range leaves no room below it")


@needs_room
@pytest.mark.parametrize("n", [pytest.param(1, id="one"), pytest.param(3, id="three-consecutive")])
def test_ports_are_free_below_the_ephemeral_range_and_never_handed_out_twice(n):
    low = ports.ephemeral_low()
    seen: set[int] = set()
    for _ in range(20):
        base = ports.free_ports(n)
        assert ports.FIRST_PORT <= base and base + n <= low
        assert all(_bindable(p) for p in range(base, base + n))
        assert not seen.intersection(range(base, base + n))
        seen.update(range(base, base + n))


@needs_room
def test_a_port_taken_or_handed_out_before_is_passed_over(monkeypatch):
    """Draws land on a port somebody holds, then on one this process handed out: both are passed over."""
    before = ports.free_port()
    fresh = next(p for p in range(ports.FIRST_PORT, ports.ephemeral_low())
                 if p not in ports._handed_out and _bindable(p))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken, before, fresh])
        monkeypatch.setattr(ports._draw, "randrange", lambda a, b: next(draws))
        assert ports.free_port() == fresh


def test_a_seeded_random_module_does_not_repeat_the_draws():
    """Two test workers that seed `random` alike must not draw the same ports."""
    state = random.getstate()
    try:
        random.seed(7)
        first = [ports.free_port() for _ in range(5)]
        random.seed(7)
        again = [ports.free_port() for _ in range(5)]
    finally:
        random.setstate(state)
    assert again != first


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.FIRST_PORT + 50)
    port = ports.free_port()
    assert port >= ports.FIRST_PORT + 50 and _bindable(port)
