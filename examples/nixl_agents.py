#!/usr/bin/env python3
"""Two NIXL agents moving memory over our engine (NIXL backend "MOONCAKE").

Needs NIXL (`pip install nixl`, or on CPU: `pip install numpy` and
`pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`). NIXL loads plugins from one
directory; `mooncake-plugins nixl-plugin-dir` prints one holding ours beside NIXL's own.
This script sets it itself, before its first agent:

    python examples/nixl_agents.py
"""

import os
import time

import numpy as np

from mooncake_plugins.nixl.plugin_dir import plugin_dir

os.environ.setdefault("NIXL_PLUGIN_DIR", str(plugin_dir()))
os.environ.setdefault("NIXL_MOONCAKE_IP_ADDR", "127.0.0.1")  # serve on loopback here

from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402


def main() -> None:
    config = nixl_agent_config(backends=["MOONCAKE"])
    prefill, decode = nixl_agent("prefill", config), nixl_agent("decode", config)
    kv = np.arange(16 << 20, dtype=np.uint8)  # the prefill's KV blocks
    pulled = np.zeros_like(kv)
    prefill.register_memory([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM")
    decode.register_memory([(pulled.ctypes.data, pulled.nbytes, 0, "")], "DRAM")
    decode.add_remote_agent(prefill.get_agent_metadata())  # metadata travels as bytes
    prefill.add_remote_agent(decode.get_agent_metadata())

    block = 1 << 20
    mine = decode.prep_xfer_dlist("", [(pulled.ctypes.data + i * block, block, 0)
                                       for i in range(16)], "DRAM")
    theirs = decode.prep_xfer_dlist("prefill", [(kv.ctypes.data + i * block, block, 0)
                                                for i in range(16)], "DRAM")
    handle = decode.make_prepped_xfer("READ", mine, list(range(16)), theirs, list(range(16)),
                                      b"request-1 pulled")
    decode.transfer(handle)
    while decode.check_xfer_state(handle) == "PROC":
        time.sleep(0.001)
    assert np.array_equal(kv, pulled)
    while not (notifs := prefill.get_new_notifs()):
        time.sleep(0.001)
    print("pulled 16 MiB; the prefill was told:", notifs)
    decode.release_xfer_handle(handle)


if __name__ == "__main__":
    main()
