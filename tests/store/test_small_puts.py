"""Small puts copy their values into registered scratch buffers of the client: each buffer
is lent to one call at a time, so concurrent puts never mix their bytes, and one that a
failed put may still be read from is not lent again."""

from __future__ import annotations

import os
import threading

from mooncake_plugins.store.client import SMALL_PUT_NBYTES, StoreClient


def test_concurrent_small_puts_keep_their_own_bytes(master):
    with StoreClient(master.address, global_segment_size=32 << 20) as c:
        values = {f"t{t}-{i}": os.urandom(1024 + (t * 977 + i * 131) % 7000)
                  for t in range(8) for i in range(150)}
        keys = sorted(values)
        errors: list[BaseException] = []

        def put(part: list[str]) -> None:
            try:
                for k in part:
                    c.put(k, values[k])
            except BaseException as exc:   # reported below
                errors.append(exc)

        threads = [threading.Thread(target=put, args=(keys[t::8],)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors[:1]
        assert all(c.get(k) == values[k] for k in keys)
        assert 1 <= len(c._scratch._free) <= 8, "at most one buffer per concurrent call"
        # a batch past the scratch size goes the registered way, and still round-trips
        big = [os.urandom(SMALL_PUT_NBYTES // 2 + 1) for _ in range(2)]
        assert c.batch_put(["b0", "b1"], big) == [None, None]
        assert c.batch_get(["b0", "b1"]) == big


def test_a_failed_put_does_not_lend_its_buffer_again(master, monkeypatch):
    with StoreClient(master.address, global_segment_size=8 << 20) as c:
        c.put("warm", b"x" * 100)
        lent = list(c._scratch._free)
        assert len(lent) == 1
        monkeypatch.setattr(c, "_run", lambda op, plan: {0: OSError("link down")})
        (err,) = c.batch_put(["lost"], [b"y" * 100])
        assert err is not None and "link down" in str(err)
        assert c._scratch._free == [], "the buffer a failed put used is dropped"
        monkeypatch.undo()
        c.put("after", b"z" * 100)
        assert c.get("after") == b"z" * 100 and c._scratch._free[0] is not lent[0]
