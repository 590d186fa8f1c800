"""The SSD tier: objects written to files under a directory shared by clients and master.

A client started with ``enable_ssd_offload`` writes each object it puts to a file in the
background and reports the key to the master (``add_disk_replica``); an object evicted
from memory stays readable from that file. The master never takes a path from the
network: a disk replica is the *name* :func:`relative_name` derives from the key, under
the master's ``root_fs_dir``; readers open it under their own ``ssd_offload_path`` (the
same directory, or a mount of the same shared filesystem, as the original's DFS tier).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from typing import Sequence

_NAME = re.compile(r"([0-9a-f]{2})/\1[0-9a-f]{38}\.obj")


def relative_name(key: str) -> str:
    """The file name of ``key``'s disk replica, relative to the tier's root (any key is safe)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()
    return f"{digest[:2]}/{digest}.obj"


def path_for(directory: str, key: str) -> str:
    """The file of ``key``'s disk replica under ``directory``."""
    return os.path.join(directory, relative_name(key))


def is_valid_name(name: object) -> bool:
    """Whether ``name`` has the shape :func:`relative_name` produces (no other file can match)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def resolve(root: str, name: object) -> str:
    """``root/name`` for a well-formed disk replica name (ValueError otherwise)."""
    if not is_valid_name(name):
        raise ValueError(f"{name!r:.100} is not a disk replica name (xx/<40 hex>.obj)")
    return os.path.join(root, name)


def delete_under(root: str, name: str) -> bool:
    """Delete the disk replica ``name`` if it is a regular file inside ``root``.

    Nothing else is ever touched: the name must be well-formed, ``realpath(root/name)``
    must lie inside ``realpath(root)``, and the unlink goes through directory descriptors
    opened without following symlinks (so a directory swapped for a link meanwhile fails).

    Returns:
        True when the file was deleted, False when it was absent.

    Raises:
        ValueError: the name or the resolved path is outside the root (nothing touched).
        OSError: the deletion failed.
    """
    path = resolve(root, name)
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        raise ValueError(f"{path} resolves outside {real_root}")
    subdir, base = name.split("/")
    nofollow = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        root_fd = os.open(real_root, nofollow)
    except FileNotFoundError:
        return False
    try:
        try:
            dir_fd = os.open(subdir, nofollow, dir_fd=root_fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError(f"{os.path.join(root, subdir)} is a symlink") from None
            raise
        try:
            os.unlink(base, dir_fd=dir_fd)
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(dir_fd)
    finally:
        os.close(root_fd)


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


def read_range_into(path: str, size: int, offset: int, dests: Sequence[memoryview]) -> None:
    """Read bytes from ``offset`` of the ``size``-byte offloaded object into ``dests``, in
    order (OSError if absent or truncated; ValueError if the file is not ``size`` long)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        found = os.fstat(fd).st_size
        if found != size:  # never hand out other bytes as the object's
            raise ValueError(f"{path} holds {found} bytes, the object {size}")
        for dest in dests:
            done = 0
            while done < len(dest):
                n = os.preadv(fd, [dest[done:]], offset + done)
                if n == 0:
                    raise OSError(f"{path} was truncated while reading")
                done += n
            offset += done
    finally:
        os.close(fd)
