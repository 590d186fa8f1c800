"""One SGLang PD process on the drop-in ``mooncake`` package, driven over stdin/stdout.

The process publishes SGLang ``ServerArgs`` as a PD server would, and SGLang's own
``maybe_init_shared_mooncake_transfer_engine`` builds its ``MooncakeTransferEngine``,
which asks ``TransferEngine.initialize`` for ``rdma`` (``MOONCAKE_PROTOCOL``'s default):
``engine`` runs with ``--disaggregation-transfer-backend mooncake`` (no RDMA here: the
drop-in, like the original, falls back to tcp), ``pd`` with ``mooncake_tcp`` (SGLang
sets ``MC_FORCE_TCP=1``). Its host address comes from ``SGLANG_HOST_IP``.

``engine``: two CPU tensors of pages, ``a`` registered by SGLang's ``register`` and ``b``
by ``batch_register``. Prints ``READY {"session", "a", "b"}``, then answers:
``fill <seed>`` / ``digests`` (sha256 prefixes of every page of a then b),
``batch <session> <peer a> <src,...> <dst,...>`` (``batch_transfer_sync`` of pages of a),
``single <session> <peer b> <src> <dst>`` (``transfer_sync`` of one page of b),
``probe <session>``, ``deregister`` (``deregister`` a, ``batch_deregister`` b), ``quit``.

``pd <prefill|decode> <bootstrap port>``: SGLang's ``MooncakeKVManager`` over a
``KVArgs`` built as SGLang's prefill/decode builds it, from SGLang's own CPU KV pool
(``MHATokenToKVPool``, device cpu) and ``MetadataBuffers``; the prefill one also runs the
``MooncakeKVBootstrapServer``. Prints ``READY {"session"}``, then answers JSON:
prefill ``open <room>`` (a ``MooncakeKVSender``, answered once decode's request arrived:
``{"status"}``), ``send <room> <page,...> <aux> <seed>`` (KV of those pages and aux row
``aux`` filled from ``seed``, sent; ``{"status", "digests", "aux"}`` once it concluded);
decode ``request <room> <page,...> <aux>`` (a ``MooncakeKVReceiver`` that sent its page
indices: ``{"status"}``), ``poll <room> <page,...> <aux>`` (``{"status", "digests",
"aux"}`` once concluded), ``teardown`` (the manager's ``teardown``: threads stopped, memory
deregistered). ``quit`` tears down and exits.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import pools  # before SGLang: puts the torchvision stand-in in place
import torch
from sglang.srt import runtime_context
from sglang.srt.server_args import ServerArgs
from transformers import LlamaConfig

LAYERS, HEADS, HEAD_DIM, PAGE = pools.LAYERS, pools.HEADS, pools.HEAD_DIM, pools.PAGE
TOKENS = 64  # KV pool slots (16 pages)
ENGINE_PAGES, ENGINE_PAGE_BYTES = 8, 4096
POLL_TIMEOUT_S = 60.0


def publish(role: str, backend: str, bootstrap_port: int, model_dir: str) -> ServerArgs:
    """Install SGLang's process-wide config for one TP-1 PD server on CPU, for a tiny
    Llama whose config (no weights: none are loaded) is written to ``model_dir``."""
    LlamaConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=32, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=HEADS,
                vocab_size=128, architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
    args = ServerArgs(model_path=model_dir, device="cpu", host="127.0.0.1",
                      disaggregation_mode=role, disaggregation_transfer_backend=backend,
                      disaggregation_bootstrap_port=bootstrap_port, enable_pd_role_switch=True)
    runtime_context.publish(args, role="scheduler",
                            ranks=runtime_context.SpawnRanks(world_rank=0))
    # A PP-1 server never uses its pipeline group; without torch.distributed groups
    # (built only when a model runs) SGLang asks for it to be stated.
    runtime_context.get_parallel().override_permanently(pp_group=None)
    return args


def transfer_engine() -> Any:
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        get_mooncake_transfer_engine, maybe_init_shared_mooncake_transfer_engine)

    maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    engine = get_mooncake_transfer_engine()
    assert engine is not None, "SGLang did not ask for a Mooncake transfer engine"
    return engine


def ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",")]


def short(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def serve(ready: dict[str, Any], handlers: dict[str, Callable[..., Any]]) -> None:
    print("READY " + json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        try:
            answer = handlers[cmd[0]](*cmd[1:])
        except Exception as exc:  # report to the test, keep serving
            answer = f"error {type(exc).__name__}: {exc}".replace("\n", " ")
        print(answer if isinstance(answer, str) else json.dumps(answer), flush=True)


# -- engine ---------------------------------------------------------------------------
def run_engine(model_dir: str) -> None:
    publish("prefill", "mooncake", 0, model_dir)
    te = transfer_engine()
    a = torch.zeros(ENGINE_PAGES * ENGINE_PAGE_BYTES, dtype=torch.uint8)
    b = torch.zeros_like(a)
    te.register(a.data_ptr(), a.numel())
    assert te.batch_register([b.data_ptr()], [b.numel()]) == 0

    def page(t: torch.Tensor, i: int) -> int:
        return t.data_ptr() + i * ENGINE_PAGE_BYTES

    def digests() -> list[str]:
        return [short(t[i * ENGINE_PAGE_BYTES:(i + 1) * ENGINE_PAGE_BYTES].numpy().tobytes())
                for t in (a, b) for i in range(ENGINE_PAGES)]

    def fill(seed: str) -> list[str]:
        g = torch.Generator().manual_seed(int(seed))
        for t in (a, b):
            t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
        return digests()

    def batch(session: str, peer: str, src: str, dst: str) -> str:
        s, d = ints(src), ints(dst)
        return str(te.batch_transfer_sync(session, [page(a, i) for i in s],
                                          [int(peer) + i * ENGINE_PAGE_BYTES for i in d],
                                          [ENGINE_PAGE_BYTES] * len(s)))

    def single(session: str, peer: str, src: str, dst: str) -> str:
        return str(te.transfer_sync(session, page(b, int(src)),
                                    int(peer) + int(dst) * ENGINE_PAGE_BYTES, ENGINE_PAGE_BYTES))

    def deregister() -> str:
        te.deregister(a.data_ptr())
        return str(te.batch_deregister([b.data_ptr()]))

    serve({"session": te.get_session_id(), "a": a.data_ptr(), "b": b.data_ptr()},
          {"fill": fill, "digests": digests, "batch": batch, "single": single,
           "probe": lambda session: str(te.send_probe(session)), "deregister": deregister})


# -- pd ---------------------------------------------------------------------------------
def kv_args(kv: Any, meta: Any) -> Any:
    """The ``KVArgs`` SGLang's prefill.py / decode.py build, for a TP-1 MHA model whose KV
    lives in ``kv`` and whose first-token metadata lives in ``meta``."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos, setup_state_kv_args

    args = KVArgs()
    args.engine_rank, args.pp_rank, args.system_dp_rank, args.rust_http_port = 0, 0, 0, None
    args.kv_cache_dtype_str, args.kv_layout = "float16", None
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = get_kv_transfer_buf_infos(kv)
    args.prefill_start_layer, args.prefill_end_layer = 0, LAYERS
    args.num_draft_entries, args.kv_layer_ids = 0, []
    args.kv_head_num, args.total_kv_head_num, args.page_size = HEADS, HEADS, PAGE
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    args.ib_device, args.gpu_id = "", 0
    setup_state_kv_args(args, kv, None, LAYERS)
    return args


def run_pd(role: str, bootstrap_port: int, model_dir: str) -> None:
    server_args = publish(role, "mooncake_tcp", bootstrap_port, model_dir)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake import (MooncakeKVBootstrapServer,
                                                    MooncakeKVManager, MooncakeKVReceiver,
                                                    MooncakeKVSender)
    from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    bootstrap = MooncakeKVBootstrapServer("127.0.0.1", bootstrap_port) \
        if role == "prefill" else None
    transfer_engine()
    kv = MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.float16, head_num=HEADS,
                          head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                          enable_memory_saver=False)
    meta = MetadataBuffers(size=4, hidden_size=16, hidden_states_dtype=torch.float16,
                           max_sampling_mask_tokens=0)
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    manager = MooncakeKVManager(kv_args(kv, meta), mode, server_args, False)
    bootstrap_addr = f"127.0.0.1:{bootstrap_port}"
    peers: dict[int, Any] = {}

    def page_digests(pages: list[int]) -> list[str]:
        return [short(buf[p * PAGE:(p + 1) * PAGE].contiguous().view(torch.uint8).numpy()
                      .tobytes()) for buf in kv.k_buffer + kv.v_buffer for p in pages]

    def wait(peer: Any, done: tuple[int, ...]) -> int:
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while (status := peer.poll()) not in done and time.monotonic() < deadline:
            time.sleep(0.01)
        return int(status)

    def outcome(room: str, pages: list[int], aux: int) -> dict[str, Any]:
        status = wait(peers[int(room)], (KVPoll.Success, KVPoll.Failed))
        return {"status": status, "digests": page_digests(pages),
                "aux": meta.output_ids[aux, :4].tolist()}

    def open_room(room: str) -> dict[str, Any]:
        sender = peers[int(room)] = MooncakeKVSender(manager, bootstrap_addr, int(room))
        return {"status": wait(sender, (KVPoll.WaitingForInput, KVPoll.Failed))}

    def send(room: str, pages: str, aux: str, seed: str) -> dict[str, Any]:
        idx = ints(pages)
        g = torch.Generator().manual_seed(int(seed))
        for buf in kv.k_buffer + kv.v_buffer:
            for p in idx:
                buf[p * PAGE:(p + 1) * PAGE] = torch.randn(buf[:PAGE].shape, generator=g)
        meta.output_ids[int(aux), :4] = torch.randint(0, 1 << 30, (4,), generator=g)
        sender = peers[int(room)]
        sender.init(len(idx), int(aux))
        sender.send(np.array(idx, dtype=np.int32))
        return outcome(room, idx, int(aux))

    def request(room: str, pages: str, aux: str) -> dict[str, Any]:
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while not manager.try_ensure_parallel_info(bootstrap_addr):
            assert time.monotonic() < deadline, "no prefill behind the bootstrap server"
            time.sleep(0.1)
        receiver = peers[int(room)] = MooncakeKVReceiver(manager, bootstrap_addr, int(room))
        receiver.init(0)
        receiver.send_metadata(np.array(ints(pages), dtype=np.int32), int(aux))
        return {"status": int(receiver.poll())}

    def poll(room: str, pages: str, aux: str) -> dict[str, Any]:
        return outcome(room, ints(pages), int(aux))

    def teardown() -> str:
        manager.teardown()
        return "ok"

    handlers = {"open": open_room, "send": send} if role == "prefill" else \
        {"request": request, "poll": poll}
    handlers["teardown"] = teardown
    try:
        serve({"session": manager.get_session_id()}, handlers)
    finally:
        if not manager._stopped:
            manager.teardown()
        if bootstrap is not None:
            bootstrap.close()


def main() -> None:
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    with tempfile.TemporaryDirectory() as model_dir:
        if sys.argv[1] == "engine":
            run_engine(model_dir)
        else:
            run_pd(sys.argv[2], int(sys.argv[3]), model_dir)


if __name__ == "__main__":
    main()
