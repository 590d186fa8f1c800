"""Our vLLM connectors on a CUDA KV cache, over the CUDA TEST DOUBLE (tests/cuda_double.py:
its "device memory" is memfd-backed host memory; it proves the connectors' bookkeeping, not
CUDA: tests/gpu runs the worker paths on a GPU).

The KV tensors have CUDA flash attention's layout, ``[2, num_blocks, block_size, kv_heads,
head]``, over the double's device memory, so the connectors register them as ``cuda:0``
and every byte goes through the engine's CUDA paths (pinned staging to the holder, CUDA IPC
between the P/D pair). Each transfer thread waits on an event recorded on the compute
stream when the transfer was queued (``cuda_fence``), and nothing else.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch
from cuda_double import double  # noqa: F401  (the fixture)
from harness import BLOCK, store_config
from pd_harness import PDEngine

import mooncake_vllm.cuda_fence as cuda_fence

PROMPT = [(i * 37) % 1000 + 3 for i in range(100)]   # 6 full blocks and 4 tokens
NUM_BLOCKS = 64
COMPUTE_STREAM = 0x5EED   # the handle torch would give for vLLM's compute stream


def flash_kv(drv, num_blocks: int = NUM_BLOCKS) -> dict[str, torch.Tensor]:
    """Two layers of KV in flash attention's layout, in the double's device memory."""
    kv = {}
    for name in ("layer.0", "layer.1"):
        nbytes = 2 * num_blocks * BLOCK * 4
        raw = (ctypes.c_char * nbytes).from_address(drv.alloc(nbytes))
        kv[name] = torch.frombuffer(raw, dtype=torch.float32).view(2, num_blocks, BLOCK, 1, 1)
    return kv


class StreamLog:
    """What the connectors asked of CUDA's events: on which stream each was recorded,
    which were waited for; and the copies (from the double's own log) after each wait."""

    def __init__(self, drv, monkeypatch) -> None:
        self.calls: list[tuple] = []
        self.gate = threading.Event()
        self.gate.set()
        record, sync = drv.event_record, drv.event_synchronize

        def event_record(event, stream, device):
            self.calls.append(("record", event, stream))
            record(event, stream, device)

        def event_synchronize(event, device):
            assert self.gate.wait(30)
            self.calls.append(("sync", event, len(drv.copy_log)))
            sync(event, device)

        monkeypatch.setattr(drv, "event_record", event_record)
        monkeypatch.setattr(drv, "event_synchronize", event_synchronize)
        monkeypatch.setattr(cuda_fence, "compute_stream", lambda device: COMPUTE_STREAM)

    def streams(self) -> set[int]:
        return {c[2] for c in self.calls if c[0] == "record"}

    def waited(self) -> int:
        return sum(c[0] == "sync" for c in self.calls)


def test_store_connector_saves_and_loads_a_cuda_kv_cache(store, engines, double, monkeypatch):
    log = StreamLog(double, monkeypatch)
    a = engines(store_config(store.address), kv=flash_kv(double))
    assert "cuda:0" in a.worker._worker._layout.describe()
    a.add("a", PROMPT, max_tokens=1)
    log.gate.clear()              # the forward pass "still runs": the save must wait for it
    a.step()
    copies = len(double.copy_log)
    threading.Timer(0.3, log.gate.set).start()
    a.run()
    assert a.stat("blocks_saved") == 6
    first_sync = next(c for c in log.calls if c[0] == "sync")
    assert first_sync[2] == copies, "the save copied nothing before its fence was passed"

    b = engines(store_config(store.address), kv=flash_kv(double))
    before, syncs = len(double.copy_log), log.waited()
    b.add("b", PROMPT, max_tokens=4)
    out = b.step()
    assert out.num_scheduled_tokens == {"b": len(PROMPT) - 6 * BLOCK}, "6 blocks are loaded"
    ids = b.scheduler.kv_cache_manager.get_block_ids("b")[0]
    assert all(b.block_ok(ids[i], PROMPT[i * BLOCK:(i + 1) * BLOCK], i * BLOCK)
               for i in range(6)), "the loaded blocks hold what computing the prompt writes"
    assert b.stat("blocks_loaded") == 6 and b.stat("load_errors") == 0
    assert len(double.copy_log) > before, "the load went through CUDA copies"
    assert log.waited() > syncs, "the load waited for the compute stream first"
    assert log.streams() == {COMPUTE_STREAM}, "events are recorded on the compute stream only"
    b.run()


@pytest.mark.parametrize("protocol", ["tcp", "shm"])   # shm: the engine still picks cuda_ipc
def test_pd_pair_writes_cuda_kv_between_engines(tiny_llama_config, double, monkeypatch,
                                                protocol):
    log = StreamLog(double, monkeypatch)
    extra = {"protocol": protocol}
    p = PDEngine(tiny_llama_config, "kv_producer", extra, kv=flash_kv(double, 16),
                 num_blocks=16)
    d = PDEngine(tiny_llama_config, "kv_consumer", extra, kv=flash_kv(double, 16),
                 num_blocks=16)
    try:
        p.add_pd("p", PROMPT, {"do_remote_decode": True, "transfer_id": "t1"}, max_tokens=1)
        while "p" not in p.answers:
            p.step()
        d.add_pd("d", PROMPT, p.answers["p"])
        while not any(r.finished_recving for r in d.results):
            d.step()
            p.step()
        assert not d.results[-1].failed_recving
        ids = d.scheduler.kv_cache_manager.get_block_ids("d")[0]
        assert all(d.block_ok(ids[i], PROMPT[i * BLOCK:(i + 1) * BLOCK], i * BLOCK)
                   for i in range(len(PROMPT) // BLOCK)), "the decode holds the prefill's KV"
        assert d.stat("blocks_loaded") == 7
        assert log.streams() == {COMPUTE_STREAM} and log.waited() >= 2
    finally:
        p.close()
        d.close()
