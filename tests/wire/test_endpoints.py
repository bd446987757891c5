import socket

import asyncrl.wire.endpoints as endpoints
from asyncrl.wire.endpoints import Endpoints, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low, _ = endpoints.ephemeral_range()
    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(endpoints.PORT_FLOOR <= p < low for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_free_ports_skip_a_port_in_use(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    # The pool is the taken port and the seven above it (pretending the range starts there).
    monkeypatch.setattr(endpoints, "PORT_FLOOR", port)
    monkeypatch.setattr(endpoints, "ephemeral_range", lambda: (port + 8, 60999))
    try:
        for _ in range(20):
            assert free_ports(1) != [port]
    finally:
        taken.close()


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(endpoints, "ephemeral_range", lambda: (endpoints.PORT_FLOOR + 2, 60999))
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)


def test_a_run_takes_one_address_per_socket():
    e = Endpoints.allocate()
    addresses = [a for a in e.model_dump().values() if a is not None]
    assert len(set(addresses)) == len(addresses) == len(Endpoints.model_fields)
    assert all(a.startswith("tcp://127.0.0.1:") for a in addresses)
