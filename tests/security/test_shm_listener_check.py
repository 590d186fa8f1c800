"""The shm transport's check that a descriptor's pid owns the port it was fetched from.

A remote peer can publish a descriptor naming any local pid; copies go to a process's
memory only when that process holds the listening socket of the segment's port. The
check asks the kernel's sock_diag for listeners, falling back to /proc/net/tcp: both
must find the same sockets.
"""

from __future__ import annotations

import os
import socket

import pytest

from mooncake_plugins.transfer.transports import shm


@pytest.fixture
def listeners():
    socks = {}
    for name, family, host in (("lo", socket.AF_INET, "127.0.0.1"),
                               ("any", socket.AF_INET, "0.0.0.0"),
                               ("any6", socket.AF_INET6, "::")):
        sock = socket.socket(family)
        sock.bind((host, 0))
        sock.listen()
        socks[name] = sock
    connected = socket.create_connection(("127.0.0.1", socks["lo"].getsockname()[1]))
    yield socks
    connected.close()
    for sock in socks.values():
        sock.close()


def test_sock_diag_and_proc_find_the_same_listeners(listeners) -> None:
    for sock in listeners.values():
        port, inode = sock.getsockname()[1], os.fstat(sock.fileno()).st_ino
        fast = shm._listener_inodes_netlink(socket.inet_aton("127.0.0.1"), port)
        assert fast == {inode}
        assert fast == shm._listener_inodes("127.0.0.1", port)
    port = listeners["lo"].getsockname()[1]
    assert shm._listener_inodes_netlink(socket.inet_aton("10.9.9.9"), port) == set()


def test_only_the_owner_of_the_port_serves_it(listeners, monkeypatch: pytest.MonkeyPatch) -> None:
    port = listeners["lo"].getsockname()[1]
    assert shm.serves(os.getpid(), "127.0.0.1", port)
    assert not shm.serves(1, "127.0.0.1", port)  # another local process: refused
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, not listening
        assert not shm.serves(os.getpid(), "127.0.0.1", unused.getsockname()[1])

    def no_sock_diag(host: bytes, port: int) -> set[int]:
        raise OSError("no sock_diag")
    monkeypatch.setattr(shm, "_listener_inodes_netlink", no_sock_diag)
    assert shm.serves(os.getpid(), "127.0.0.1", port)  # the /proc fallback
    assert not shm.serves(1, "127.0.0.1", port)
