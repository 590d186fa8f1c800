"""SGLang PD's ``mooncake`` transfer backend, unchanged, on the drop-in ``mooncake``
package, in two processes (``pd_peer.py``): SGLang's own ``MooncakeTransferEngine``
wrapper, and SGLang's ``MooncakeKVManager``/``MooncakeKVSender``/``MooncakeKVReceiver``
with their bootstrap server moving a request's KV pages from a prefill-mode manager to a
decode-mode manager; bytes compared. The wrapper runs with SGLang's default
``--disaggregation-transfer-backend mooncake`` (it asks for rdma, which falls back to tcp
as with the original), the managers with ``mooncake_tcp`` (``MC_FORCE_TCP``)."""

from __future__ import annotations

import contextlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
from helpers import LineChild, free_port

HERE = Path(__file__).resolve().parent
PEER = [sys.executable, str(HERE / "pd_peer.py")]
SUCCESS, FAILED, WAITING = 4, 0, 2  # sglang.srt.disaggregation.base.conn.KVPoll


def peer(*args: str) -> LineChild:
    return LineChild(PEER + list(args), timeout_s=180)


def send_line(child: LineChild, line: str) -> None:
    """A command whose answer is read later (the other process must act first)."""
    child.proc.stdin.write((line + "\n").encode())
    child.proc.stdin.flush()


def csv(pages: list[int]) -> str:
    return ",".join(map(str, pages))


def answer(line: str) -> dict:
    assert not line.startswith("error"), line
    return json.loads(line)


@contextlib.contextmanager
def pair(prefill_args: list[str], decode_args: list[str]) -> Iterator[tuple[LineChild,
                                                                            LineChild]]:
    """Two peers, started side by side (each takes seconds to import SGLang)."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(peer, *a) for a in (prefill_args, decode_args)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        yield started[0], started[1]
    finally:
        for child in reversed(started):
            child.close()


@pytest.fixture
def engines() -> Iterator[tuple[LineChild, LineChild]]:
    with pair(["engine"], ["engine"]) as peers:
        yield peers


def test_sglang_transfer_engine_wrapper_moves_pages(engines):
    prefill, decode = engines
    session, a, b = decode.info["session"], decode.info["a"], decode.info["b"]
    assert session.startswith("127.0.0.1:") and session != prefill.info["session"]
    src = answer(prefill.ask("fill 5"))
    before = answer(decode.ask("fill 9"))
    assert prefill.ask(f"batch {session} {a} 0,2,5 1,3,7") == "0"
    assert prefill.ask(f"single {session} {b} 4 6") == "0"
    got = answer(decode.ask("digests"))
    n = len(got) // 2  # pages of a, then pages of b
    want = list(before)
    for s, d in ((0, 1), (2, 3), (5, 7)):
        want[d] = src[s]
    want[n + 6] = src[n + 4]
    assert got == want  # exactly the pages sent changed, to the sender's bytes
    assert prefill.ask(f"probe {session}") == "0"
    assert decode.ask("deregister") == "0"
    assert int(prefill.ask(f"batch {session} {a} 0 0")) < 0  # deregistered: refused
    assert int(prefill.ask(f"single {session} {b} 0 0")) < 0
    assert answer(decode.ask("digests")) == want
    decode.close()
    assert int(prefill.ask(f"probe {session}")) < 0  # the peer is gone


@pytest.fixture
def pd() -> Iterator[tuple[LineChild, LineChild]]:
    port = str(free_port())
    with pair(["pd", "prefill", port], ["pd", "decode", port]) as peers:
        yield peers


def bootstrap(prefill: LineChild, decode: LineChild, room: int, dst: list[int],
              aux: int) -> None:
    """The decode side asks for ``room`` into pages ``dst``; the prefill side's sender
    then waits for input, as SGLang's schedulers do."""
    send_line(prefill, f"open {room}")
    assert answer(decode.ask(f"request {room} {csv(dst)} {aux}"))["status"] != FAILED
    assert answer(prefill.readline(90))["status"] == WAITING


def test_kv_pages_of_a_request_move_from_prefill_to_decode(pd):
    prefill, decode = pd
    for room, src, dst, aux in ((101, [1, 3, 5], [7, 2, 9], 1), (102, [4, 6], [11, 12], 2)):
        bootstrap(prefill, decode, room, dst, aux)
        sent = answer(prefill.ask(f"send {room} {csv(src)} {aux} {room}", 90))
        got = answer(decode.ask(f"poll {room} {csv(dst)} {aux}", 90))
        assert sent["status"] == SUCCESS and got["status"] == SUCCESS
        assert got["digests"] == sent["digests"]  # every layer's k and v of each page
        assert got["aux"] == sent["aux"]  # the first output token's metadata row


def test_decode_that_deregistered_fails_the_request(pd):
    prefill, decode = pd
    bootstrap(prefill, decode, 201, [3, 4], 0)
    assert decode.ask("teardown") == "ok"  # its KV memory leaves the engine
    sent = answer(prefill.ask(f"send 201 {csv([1, 2])} 0 7", 90))
    assert sent["status"] == FAILED
