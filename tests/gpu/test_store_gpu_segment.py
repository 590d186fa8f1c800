"""A store holder lending GPU memory as its segment, on a real GPU (marker ``cuda``): a
holder process with ``segment_location="cuda:0"``, and a client in this process that puts
64 MiB objects into it (cuda_ipc from this process's host memory and device memory) and
reads them back equal, then over tcp only (the holder's server stages its device memory).
"""

from __future__ import annotations

import os
import textwrap

import pytest
from peers import Target

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.store.client import StoreClient
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions
from mooncake_plugins.transfer import TransferEngine, cuda, memory

pytestmark = pytest.mark.cuda

MIB = 1 << 20

HOLDER = textwrap.dedent("""
    import sys
    from mooncake_plugins.store.client import StoreClient
    client = StoreClient(%r, global_segment_size=%d, segment_location="cuda:0")
    print(client.segment_name, 0, flush=True)
    sys.stdin.readline()
    client.close()
    print("bye", flush=True)
""")


@pytest.mark.parametrize("transports", [["cuda_ipc", "shm", "tcp"], ["tcp"]])
def test_objects_live_in_a_holders_gpu_memory(transports) -> None:
    server = MasterServer(MasterConfig(), ServerOptions(rpc_port=0))
    server.start()
    try:
        with Target(HOLDER % (server.address, 256 * MIB)), \
                TransferEngine(config=EngineConfig(transports=transports)) as eng, \
                StoreClient(server.address, global_segment_size=0, engine=eng) as client, \
                cuda.DeviceBuffer(64 * MIB) as dev:
            data = os.urandom(64 * MIB)
            client.put("host-bytes", data)
            assert client.get("host-bytes") == data
            staging = bytearray(data[::-1])
            cuda.copy(dev.address, memory.address_of(staging)[0], len(staging))
            client.register_buffer(dev.address, dev.nbytes)
            client.put_from("device-bytes", dev.address, dev.nbytes)
            assert client.get("device-bytes") == bytes(staging)
            client.unregister_buffer(dev.address)
    finally:
        server.close()
