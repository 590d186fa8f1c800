"""The original's per-put options: ``ReplicateConfig`` with ``SoftPinAction`` and
``ObjectDataType``, as ``mooncake.store`` spells them.

Stores with the original's API (``compat.store``) take them, and the structured store
(``compat.structured``) makes them for the writes it passes to such stores.
``ReplicateConfig._ours()`` gives the :class:`.client.ReplicateConfig` our StoreClient takes.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # .client is imported on first use: the structured store needs only this
    from .client import ReplicateConfig as _Config


class SoftPinAction(enum.IntEnum):
    """What a put does to the object's soft pin (the original's values)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2

    def __str__(self) -> str:
        return f"SoftPinAction.{self.name}"


class ObjectDataType(enum.IntEnum):
    """The original's hint of what an object holds (accepted; placement ignores it here)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9

    def __str__(self) -> str:
        return f"ObjectDataType.{self.name}"


_U64 = (1 << 64) - 1


class ReplicateConfig:
    """The original's ReplicateConfig: placement and pinning of one put.

    ``soft_pin_action``/``soft_pin_ttl_ms`` and ``with_hard_pin`` act as in the original
    (a TTL is only valid with ``SoftPinAction.ENABLE``: the put returns -600 otherwise);
    ``with_soft_pin`` is the older spelling of ENABLE. ``nof_replica_num``,
    ``dfs_replica_num``, ``preferred_nof_segments`` (NVMe-oF and DFS tiers), ``data_type``,
    ``prefer_alloc_in_same_node`` and ``group_ids`` are accepted and kept, without effect.
    """

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids: list[str] | None = None  # the original's placement groups (kept, unused here)
        self._soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms: int | None = None

    @property
    def soft_pin_action(self) -> SoftPinAction:
        return self._soft_pin_action

    @soft_pin_action.setter
    def soft_pin_action(self, value: SoftPinAction) -> None:
        if not isinstance(value, SoftPinAction):
            raise TypeError(f"soft_pin_action must be a SoftPinAction, got {value!r}")
        self._soft_pin_action = value

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        """Soft pin TTL for ENABLE (None: the master's default)."""
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 0 <= value <= _U64):
            raise TypeError(f"soft_pin_ttl_ms must be None or an int in [0, 2**64), got {value!r}")
        self._soft_pin_ttl_ms = value

    def _ours(self) -> _Config:
        from .client import ReplicateConfig as _Config
        preferred = list(self.preferred_segments)
        if self.preferred_segment and self.preferred_segment not in preferred:
            preferred.insert(0, self.preferred_segment)
        return _Config(int(self.replica_num), preferred, bool(self.with_soft_pin),
                       self._soft_pin_action.name.lower(), self._soft_pin_ttl_ms,
                       bool(self.with_hard_pin))

    def __str__(self) -> str:
        ttl = "default" if self._soft_pin_ttl_ms is None else self._soft_pin_ttl_ms
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, soft_pin_action: "
                f"{self._soft_pin_action.name}, soft_pin_ttl_ms: {ttl}, with_hard_pin: "
                f"{int(self.with_hard_pin)}, preferred_segments: {self.preferred_segments}, "
                f"preferred_segment: {self.preferred_segment!r} }}")

    __repr__ = __str__
