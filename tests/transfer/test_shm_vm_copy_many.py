"""process_vm copies in batches (``vm_copy_many``): up to 1024 iovecs per system call,
on the native and pure-Python data paths. Copying within this very process is allowed by
process_vm_readv/writev, so the bytes can be checked against numpy directly."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mooncake_plugins.transfer.transports import shm


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_many_copies_of_every_size_land_where_asked(impl, write):
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 3000, 2600)  # more than two system calls' worth, empties too
    sizes[::97] = 0
    total = int(sizes.sum())
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total + 4096, np.uint8)
    # the pieces land in reverse order: each must pair with its own destination
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    targets = total - offsets - sizes
    copies = [(int(src.ctypes.data + o), int(dst.ctypes.data + t), int(n))
              for o, t, n in zip(offsets, targets, sizes)]
    if write:  # ours -> theirs: (local=src, remote=dst)
        shm.impl.vm_copy_many(os.getpid(), copies, True)
    else:  # theirs -> ours: (local=dst, remote=src)
        shm.impl.vm_copy_many(os.getpid(), [(r, l, n) for l, r, n in copies], False)
    expected = np.zeros_like(dst)
    for o, t, n in zip(offsets, targets, sizes):
        expected[t:t + n] = src[o:o + n]
    assert np.array_equal(dst, expected)


def test_a_bad_address_raises_after_the_good_copies(impl):
    buf = np.ones(8192, np.uint8)
    good = (buf.ctypes.data, buf.ctypes.data + 4096, 1024)
    with pytest.raises(OSError):
        shm.impl.vm_copy_many(os.getpid(), [good, (buf.ctypes.data, 8, 1024)], False)
    shm.impl.vm_copy_many(os.getpid(), [], True)  # nothing to do
