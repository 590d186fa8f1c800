"""The implementation in use is the one asked for: native when built, Python when forced."""

import os

from mooncake_plugins.transfer import memory
from mooncake_plugins.transfer.transports import shm, tcp


def test_implementation_matches_mode():
    want = "python" if os.environ.get("MOONCAKE_PUREPYTHON") == "1" else "native"
    assert (memory.IMPLEMENTATION, tcp.IMPLEMENTATION, shm.IMPLEMENTATION) == (want,) * 3
