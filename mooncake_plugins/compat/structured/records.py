"""The public records of the bundle store: policies, schemas, references and read plans.

All are plain dataclasses with the original Mooncake's names and fields, so scripts that
build or inspect them keep working.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

DEFAULT_BUNDLE_CHUNK_BYTES = 64 * 1024 ** 2
"""Payloads are cut into store objects of at most this many bytes."""
AUTO_PARALLEL_MIN_BYTES = DEFAULT_BUNDLE_CHUNK_BYTES
"""``put_mode="auto"`` writes in parallel only from this many bytes ..."""
AUTO_PARALLEL_MIN_CHUNKS = 8
"""... and this many chunks on."""
FIELD_SPECS_KEY = "__mooncake_structured_fields__"
"""Key of the per-member encodings inside a structured object's metadata."""
MISSING_OBJECT_ERROR = -704
"""Status a store's ``remove`` gives for an object that is already gone."""

PUT_MODES = ("auto", "batch", "parallel")
COPY_MODES = ("auto", "zero_copy", "copy")


@dataclass(frozen=True)
class BundleTransferPolicy:
    """How payload chunks are written.

    ``max_inflight_put``: writer threads for ``put_mode="parallel"`` (``"auto"`` goes
    parallel only for large payloads). ``copy_mode``: ``"copy"`` always uses the store's
    plain ``put``; ``"zero_copy"`` refuses anything that would need a staging copy.
    """

    max_inflight_put: int = 1
    put_mode: Literal["auto", "batch", "parallel"] = "auto"
    copy_mode: Literal["auto", "zero_copy", "copy"] = "auto"

    def validated(self, max_inflight_put: int | None = None) -> "BundleTransferPolicy":
        """This policy (with ``max_inflight_put`` overridden when given), checked."""
        policy = self if max_inflight_put is None else BundleTransferPolicy(
            max_inflight_put, self.put_mode, self.copy_mode)
        if policy.max_inflight_put < 1:
            raise ValueError("max_inflight_put must be positive")
        if policy.put_mode not in PUT_MODES:
            raise ValueError(f"unsupported put_mode: {policy.put_mode}")
        if policy.copy_mode not in COPY_MODES:
            raise ValueError(f"unsupported copy_mode: {policy.copy_mode}")
        return policy

    def as_copy(self) -> "BundleTransferPolicy":
        """The same policy with ``copy_mode="copy"``."""
        if self.copy_mode == "copy":
            return self
        return BundleTransferPolicy(self.max_inflight_put, self.put_mode, "copy")


@dataclass(frozen=True)
class FieldSchema:
    """Codec hint for one DataProto field; ``metadata["section"]`` may pin it to
    ``batch``, ``non_tensor_batch`` or ``meta_info``, ``metadata["dtype"]`` set a dtype."""

    codec: str
    nullable: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RemoteBundleRef:
    """A stored bundle: its manifest key and (possibly empty, then fetched) manifest."""

    manifest_key: str
    manifest: dict[str, Any]


@dataclass(frozen=True, init=False)
class StructuredObjectPayload:
    """A structured object to store: JSON metadata plus named members."""

    metadata: Mapping[str, Any]
    buffers: Mapping[str, Any]

    def __init__(self, metadata: Mapping[str, Any] | None = None,
                 buffers: Mapping[str, Any] | None = None) -> None:
        if buffers is None:
            raise TypeError("StructuredObjectPayload requires buffers")
        object.__setattr__(self, "metadata", {} if metadata is None else metadata)
        object.__setattr__(self, "buffers", buffers)


@dataclass
class StructuredObjectResult:
    """A materialized structured object: its metadata and the members read."""

    metadata: dict[str, Any]
    objects: dict[str, Any]


@dataclass(frozen=True)
class StructuredFieldLocation:
    """Where a DataProto field lives: a stage's bundle and the member inside it."""

    stage: str
    member: str
    section: Literal["batch", "non_tensor_batch"]


@dataclass
class MooncakeDataProtoRef:
    """A stored DataProto: one structured object per stage and where each field is."""

    batch_size: int
    stage_refs: dict[str, RemoteBundleRef]
    field_index: dict[str, StructuredFieldLocation]
    meta_info: dict[str, Any]
    namespace: str = "default"
    partition: str = "default"
    global_indexes: list[int] | None = None
    encoded_non_tensor: dict[str, Any] = field(default_factory=dict)
    _storage_group_id: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class StructuredMemberSlice:
    """Rows ``start:end:step`` of one member along ``axis`` (only 0 is supported)."""

    axis: int
    start: int
    end: int
    step: int = 1

    def bounds(self, total_rows: int) -> tuple[int, int, int]:
        """``(start, end, step)`` clipped to ``total_rows``; the step must be positive."""
        if self.step <= 0:
            raise ValueError("structured ndarray slicing step must be positive")
        return slice(self.start, self.end, self.step).indices(total_rows)

    def count(self, total_rows: int) -> int:
        """Rows the slice selects out of ``total_rows``."""
        return len(range(*self.bounds(total_rows)))


@dataclass(frozen=True)
class StructuredObjectReadSpec:
    """A lazy read of a structured object: which members, and which rows of each."""

    ref: RemoteBundleRef | Mapping[str, Any]
    member_names: tuple[str, ...] | None = None
    member_slices: tuple[tuple[str, StructuredMemberSlice], ...] = ()

    def select_members(self, names: Sequence[str] | None) -> "StructuredObjectReadSpec":
        """A spec reading only ``names`` (None: every member)."""
        return StructuredObjectReadSpec(self.ref, None if names is None else tuple(names),
                                        self.member_slices)

    def slice_member(self, name: str, axis: int, start: int, end: int,
                     step: int = 1) -> "StructuredObjectReadSpec":
        """A spec reading rows ``start:end:step`` of member ``name``."""
        slices = dict(self.member_slices)
        slices[name] = StructuredMemberSlice(axis, start, end, step)
        return StructuredObjectReadSpec(self.ref, self.member_names, tuple(slices.items()))

    def member_slice(self, name: str) -> StructuredMemberSlice | None:
        """The slice set for ``name``, if any."""
        return dict(self.member_slices).get(name)
