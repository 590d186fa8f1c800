"""What a store request may name and hold: the key and size limits the master enforces
and the client checks ahead (whether a key is valid, whether a put fits a reserved slot).

Below both ``master.py`` and ``client.py``, so that neither imports the other for them.
"""

from __future__ import annotations

from ..errors import InvalidKey

MAX_KEY_NBYTES = 4096
MAX_OBJECT_NBYTES = 1 << 40
MAX_SLOT_NBYTES = 64 << 10
"""The largest object a reserved slot holds (the one-round-trip put is for small ones)."""


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_NBYTES:
        raise InvalidKey(f"keys are non-empty str of at most {MAX_KEY_NBYTES} bytes, got {key!r:.80}")
    return key
