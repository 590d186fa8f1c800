"""The SSD tier: objects written to files under the client's offload directory.

A client started with ``enable_ssd_offload`` writes each object it puts to a file in the
background and reports it to the master (``add_disk_replica``); an object evicted from
memory stays readable from that file. Readers on another host need the directory on a
shared filesystem (as the original's DFS tier does).
"""

from __future__ import annotations

import hashlib
import os


def path_for(directory: str, key: str) -> str:
    """A file name for ``key`` that is safe whatever the key contains."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()
    return os.path.join(directory, digest[:2], digest + ".obj")


def write_file(path: str, data: memoryview) -> None:
    """Write ``data`` atomically (temp file + rename) and fsync it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_file_into(path: str, dest: memoryview) -> int:
    """Read a whole offloaded object into ``dest``; returns its size (OSError if absent)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size > len(dest):
            raise ValueError(f"{path} holds {size} bytes, more than the {len(dest)}-byte buffer")
        done = 0
        while done < size:
            n = os.preadv(fd, [dest[done:size]], done)
            if n == 0:
                raise OSError(f"{path} was truncated while reading")
            done += n
        return size
    finally:
        os.close(fd)
