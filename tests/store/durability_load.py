"""Writers and a reader running against a store while its master is killed, for the
durability tests: every acknowledged put is remembered, and can be checked byte for byte."""

from __future__ import annotations

import itertools
import random
import threading
import time

from mooncake_plugins.errors import MooncakeError, ObjectNotFound
from mooncake_plugins.store.client import StoreClient


def value(i: int) -> bytes:
    """The bytes put under ``obj-<i>`` (512 B .. 16 KiB, a function of ``i``)."""
    rng = random.Random(i)
    return rng.randbytes(512 + rng.randrange(16 << 10))


class Load:
    """``writers`` threads put fresh keys, one thread reads acknowledged ones back."""

    def __init__(self, client: StoreClient, writers: int = 2, pause_s: float = 0.004) -> None:
        self.client = client
        self._pause_s = pause_s
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.acked: dict[str, int] = {}        # key -> i, put acknowledged
        self.unacked: dict[str, int] = {}      # the put failed: the key may or may not exist
        self.corrupt: list[str] = []           # read back with other bytes
        self.last_put = 0.0                    # start time of the latest successful put
        self.last_get = 0.0                    # ... get
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._write, daemon=True) for _ in range(writers)]
        self._threads.append(threading.Thread(target=self._read, daemon=True))

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _write(self) -> None:
        while not self._stop.wait(self._pause_s):
            i = next(self._ids)
            key = f"obj-{i}"
            started = time.monotonic()
            try:
                self.client.put(key, value(i))
            except MooncakeError:
                with self._lock:
                    self.unacked[key] = i
                continue
            with self._lock:
                self.acked[key] = i
                self.last_put = max(self.last_put, started)

    def _read(self) -> None:
        rng = random.Random(0)
        while not self._stop.wait(self._pause_s):
            with self._lock:
                if not self.acked:
                    continue
                key, i = rng.choice(list(self.acked.items())[-200:])
            started = time.monotonic()
            try:
                data = self.client.get(key)
            except MooncakeError:
                continue
            with self._lock:
                if data != value(i):
                    self.corrupt.append(key)
                self.last_get = max(self.last_get, started)

    def serving_since(self, t: float) -> bool:
        """Whether a put and a get that started after ``t`` both succeeded."""
        with self._lock:
            return self.last_put > t and self.last_get > t

    def check(self) -> int:
        """Read every acknowledged object back (each must have its bytes) and every failed
        put (each must be absent or whole); returns the number of acknowledged objects."""
        with self._lock:
            acked, unacked = dict(self.acked), dict(self.unacked)
            assert not self.corrupt, f"read back with other bytes: {self.corrupt[:5]}"
        for expect_all, items in ((True, acked), (False, unacked)):
            pairs = list(items.items())
            for n in range(0, len(pairs), 256):
                chunk = pairs[n:n + 256]
                got = self.client.batch_get([k for k, _ in chunk])
                for (key, i), data in zip(chunk, got):
                    if isinstance(data, Exception):
                        assert not expect_all, f"acknowledged {key} lost: {data!r}"
                        assert isinstance(data, ObjectNotFound), f"{key}: {data!r}"
                    else:
                        assert data == value(i), f"{key} has other bytes"
        return len(acked)
