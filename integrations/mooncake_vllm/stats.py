"""Transfer counters of our connectors, in vLLM's connector-stats shape.

Workers (and the scheduler, for lookups) hand a :class:`TransferStats` to vLLM each step;
vLLM sums them per logging interval and prints ``KV Transfer metrics: ...``. Plain
counters, so aggregation is addition and the payload stays a small dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = ("lookups", "lookup_hit_tokens", "lookup_errors",
            "blocks_loaded", "bytes_loaded", "load_seconds", "load_errors",
            "blocks_saved", "bytes_saved", "save_seconds", "save_errors",
            "blocks_sent", "bytes_sent", "send_seconds", "send_errors", "sends_expired")


@dataclass
class TransferStats(KVConnectorStats):
    """Sums over an interval: lookups and hit tokens, blocks/bytes/seconds loaded,
    saved and sent (P/D prefill side), errors."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            self.data[name] = self.data.get(name, 0) + value

    def take(self) -> "TransferStats | None":
        """This interval's stats (None when nothing happened), starting a new one."""
        if self.is_empty():
            return None
        out = TransferStats(data=dict(self.data))
        self.reset()
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d: dict[str, Any] = self.data
        out = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items() if v}
        if d.get("load_seconds"):
            out["load_GBps"] = round(d["bytes_loaded"] / d["load_seconds"] / 1e9, 3)
        if d.get("save_seconds"):
            out["save_GBps"] = round(d["bytes_saved"] / d["save_seconds"] / 1e9, 3)
        if d.get("send_seconds"):
            out["send_GBps"] = round(d["bytes_sent"] / d["send_seconds"] / 1e9, 3)
        return out
