"""What this host is: its identity for same-host detection.

Two processes are on the same host for the ``shm`` transport when they share a kernel
(boot id) and a network namespace: peers in other namespaces are treated as other
hosts, which is what the netns tests rely on.
"""

from __future__ import annotations

import functools
import os
import socket


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """``<boot id>:<net namespace inode>`` of the calling process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot}:{netns}"
