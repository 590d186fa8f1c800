"""``MooncakeBundleTransfer``: bundles, structured objects and DataProtos over a store.

Layers, bottom up: :class:`~.transport.PayloadTransport` (store IO),
:class:`~.manifest.BundleManifestStore` (bundles and manifests),
:class:`~.objects.StructuredObjectLayer` (typed members), and here DataProtos: each stage
of a DataProto is one structured object whose members are ``batch.<field>`` and
``non_tensor_batch.<field>[.<payload>]``; appending to an existing stage writes the new
members as a bundle of their own and a merged manifest over both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ...store.replicate_config import ReplicateConfig
from . import dataproto as dp
from . import payloads, writes
from .manifest import BundleManifestStore, check_chunk_bytes, normalize_prefix
from .non_tensor import EncodedColumn, check_nullable, decode_column, encode_inferred, \
    encode_with_schema
from .objects import BYTES_SPEC, StructuredObjectLayer, encode_metadata, field_specs, \
    merge_stage_metadata
from .records import (DEFAULT_BUNDLE_CHUNK_BYTES, BundleTransferPolicy, FieldSchema,
                      MooncakeDataProtoRef, RemoteBundleRef, StructuredFieldLocation,
                      StructuredObjectPayload, StructuredObjectReadSpec,
                      StructuredObjectResult)
from .row_reads import RowReader
from .transport import PayloadTransport

BundleRefLike = RemoteBundleRef | Mapping[str, Any]
DataProtoRefLike = MooncakeDataProtoRef | Mapping[str, Any]
WRAPPED = "__mooncake_wrapped_object__"


class MooncakeBundleTransfer:
    """Store and read structured objects and DataProtos through a Mooncake store.

    ``store`` is any object with the original store's method names (``put``, ``get``,
    ``remove``; the batch, buffer and tensor methods are used when present).
    ``buffer_pool`` (``acquire(size)`` -> lease with ``ptr``/``buffer``/``release``)
    enables staging writes and pool-backed reads.
    """

    def __init__(self, store: Any, key_prefix: str = "bundle",
                 default_chunk_bytes: int = DEFAULT_BUNDLE_CHUNK_BYTES,
                 buffer_pool: Any = None) -> None:
        self.store = store
        self.key_prefix = normalize_prefix(key_prefix)
        self.default_chunk_bytes = check_chunk_bytes(default_chunk_bytes)
        self._transport = PayloadTransport(store, buffer_pool)
        self._bundle_store = BundleManifestStore(store, self._transport, self.key_prefix,
                                                 self.default_chunk_bytes)
        self._structured_store = StructuredObjectLayer(self._bundle_store, self._transport)

    # -- bundles and structured objects -------------------------------------------------

    def put_bundle(self, meta: Any, buffers: Mapping[str, Any], partition: str = "default",
                   chunk_bytes: int | None = None, policy: BundleTransferPolicy | None = None,
                   max_inflight_put: int | None = None, config: Any = None) -> RemoteBundleRef:
        """Store raw metadata bytes plus named byte buffers."""
        return self._bundle_store.put_bundle(meta, buffers, partition, chunk_bytes, policy,
                                             max_inflight_put, config)

    def remove_bundle(self, ref: BundleRefLike) -> None:
        """Remove every object of a bundle (strict: failures raise)."""
        self._bundle_store.remove_bundle(ref)

    def put_structured_object(self, payload: StructuredObjectPayload,
                              partition: str = "default", chunk_bytes: int | None = None,
                              policy: BundleTransferPolicy | None = None,
                              max_inflight_put: int | None = None,
                              config: Any = None) -> RemoteBundleRef:
        """Store JSON metadata plus named members (arrays, tensors, bytes)."""
        return self._structured_store.put(payload, partition, chunk_bytes, policy,
                                          max_inflight_put, config)

    def put_object(self, obj: Any, partition: str = "default", chunk_bytes: int | None = None,
                   policy: BundleTransferPolicy | None = None,
                   max_inflight_put: int | None = None, config: Any = None) -> RemoteBundleRef:
        """Store a mapping of members, or one array/tensor value."""
        payload = StructuredObjectPayload({}, obj) if isinstance(obj, Mapping) else \
            StructuredObjectPayload({WRAPPED: True}, {"value": obj})
        return self.put_structured_object(payload, partition, chunk_bytes, policy,
                                          max_inflight_put, config)

    def get_object(self, ref: BundleRefLike) -> Any:
        """What :meth:`put_object` stored."""
        result = self.materialize(self.read_spec(ref))
        return result.objects["value"] if result.metadata.get(WRAPPED) else result.objects

    def read_spec(self, ref: BundleRefLike) -> StructuredObjectReadSpec:
        """A lazy read of the whole object; narrow it with ``select_members``/``slice_member``."""
        return StructuredObjectReadSpec(ref=ref)

    def materialize(self, spec: StructuredObjectReadSpec) -> StructuredObjectResult:
        return self._structured_store.materialize_into(spec, None)

    def materialize_into(self, spec: StructuredObjectReadSpec,
                         destinations: Mapping[str, Any] | None) -> StructuredObjectResult:
        """Like :meth:`materialize`, reading members into caller ``destinations``
        (ndarrays, ``raw_destination`` or ``tensor_object_buffer``) where given."""
        return self._structured_store.materialize_into(spec, destinations)

    @staticmethod
    def release_result(result: Any) -> None:
        """Release the buffer-pool leases behind arrays in a result (idempotent)."""
        payloads.release_owners(result)

    # -- DataProtos ---------------------------------------------------------------------

    def put(self, data: Any, *, type: Literal["dataproto", "dict"] = "dataproto",
            namespace: str = "default", partition: str = "default", stage: str = "default",
            chunk_bytes: int | None = None, policy: BundleTransferPolicy | None = None,
            config: Any = None, field_schemas: Mapping[str, FieldSchema] | None = None
            ) -> MooncakeDataProtoRef:
        """Store a DataProto-like value (``type="dataproto"``) or a flat dict."""
        if type == "dict":
            data = dp.flat_dict_to_envelope(data, field_schemas)
        elif type != "dataproto":
            raise ValueError(f"unsupported Mooncake payload type: {type!r}")
        return self._put_stage(None, data, namespace=namespace, partition=partition,
                               stage=stage, chunk_bytes=chunk_bytes, policy=policy,
                               overwrite=False, schemas=field_schemas, config=config)

    def put_dataproto(self, data: Any, *, namespace: str = "default",
                      partition: str = "default", stage: str = "default",
                      chunk_bytes: int | None = None, policy: BundleTransferPolicy | None = None,
                      field_schemas: Mapping[str, FieldSchema] | None = None,
                      config: Any = None) -> MooncakeDataProtoRef:
        return self.put(data, type="dataproto", namespace=namespace, partition=partition,
                        stage=stage, chunk_bytes=chunk_bytes, policy=policy,
                        field_schemas=field_schemas, config=config)

    def append_dataproto_fields(self, ref: DataProtoRefLike, data: Any, *, stage: str,
                                overwrite: bool = False, chunk_bytes: int | None = None,
                                policy: BundleTransferPolicy | None = None,
                                field_schemas: Mapping[str, FieldSchema] | None = None,
                                config: Any = None) -> MooncakeDataProtoRef:
        """A new ref with ``data``'s fields added as (or into) ``stage``; the old ref stays
        readable unless ``overwrite`` replaced its stage."""
        ref = dp.resolve_ref(ref)
        return self._put_stage(ref, data, namespace=ref.namespace, partition=ref.partition,
                               stage=stage, chunk_bytes=chunk_bytes, policy=policy,
                               overwrite=overwrite, schemas=field_schemas, config=config)

    def get(self, ref: DataProtoRefLike, *, type: Literal["dataproto", "dict"] = "dataproto",
            fields: Sequence[str] | None = None, batch_fields: Sequence[str] | None = None,
            non_tensor_fields: Sequence[str] | None = None,
            meta_info_keys: Sequence[str] | None = None, data_cls: Any = None,
            destinations: Mapping[str, Any] | None = None, rows: Any = None) -> Any:
        """Read selected fields (and rows) as a DataProto-like value or a flat dict."""
        if type not in ("dataproto", "dict"):
            raise ValueError(f"unsupported Mooncake payload type: {type!r}")
        flat = type == "dict"
        result = self._get(ref, fields, batch_fields, non_tensor_fields, meta_info_keys,
                           dict if flat else data_cls, destinations, rows, flat)
        return dp.envelope_to_flat_dict(result) if flat else result

    def get_dataproto(self, ref: DataProtoRefLike, *, fields: Sequence[str] | None = None,
                      batch_fields: Sequence[str] | None = None,
                      non_tensor_fields: Sequence[str] | None = None,
                      meta_info_keys: Sequence[str] | None = None, data_cls: Any = None,
                      destinations: Mapping[str, Any] | None = None, rows: Any = None) -> Any:
        """Read selected fields, rows and meta_info keys of a stored DataProto."""
        return self._get(ref, fields, batch_fields, non_tensor_fields, meta_info_keys,
                         data_cls, destinations, rows, False)

    def dataproto_manifest_view(self, ref: DataProtoRefLike) -> dict[str, Any]:
        """Where each field lives and how it is encoded, from the stage manifests."""
        ref = dp.resolve_ref(ref)
        metadata = {stage: self._stage_metadata(stage_ref)
                    for stage, stage_ref in ref.stage_refs.items()}
        views: dict[str, dict[str, Any]] = {}
        for name, where in ref.field_index.items():
            specs = field_specs(metadata[where.stage])
            spec = dict(specs.get(where.member, BYTES_SPEC))
            encoded = ref.encoded_non_tensor.get(name)
            if encoded is not None:
                members = dict(encoded["payload_members"])
                spec = {"encoding": "structured_non_tensor", "codec": encoded["codec"],
                        "metadata": encoded.get("metadata"), "payload_members": members,
                        "payload_specs": {n: dict(specs.get(m, BYTES_SPEC))
                                          for n, m in members.items()}}
            views[name] = {"section": where.section, "stage": where.stage,
                           "member": where.member, "spec": spec}
        return {
            "namespace": ref.namespace, "partition": ref.partition,
            "batch_size": ref.batch_size,
            "batch_fields": {n: v for n, v in views.items() if v["section"] == "batch"},
            "non_tensor_fields": {n: v for n, v in views.items()
                                  if v["section"] == "non_tensor_batch"},
            "meta_info_keys": list(ref.meta_info),
            "stages": {stage: {"manifest_key": stage_ref.manifest_key,
                               "dataproto": metadata[stage].get("dataproto", {})}
                       for stage, stage_ref in ref.stage_refs.items()},
        }

    def cleanup_dataproto(self, ref: DataProtoRefLike) -> None:
        """Remove every stage object of a stored DataProto."""
        ref = dp.resolve_ref(ref)
        for stage_ref in {r.manifest_key: r for r in ref.stage_refs.values()}.values():
            self.remove_bundle(stage_ref)

    def cleanup_dataproto_append(self, previous: DataProtoRefLike,
                                 appended: DataProtoRefLike) -> None:
        """Remove what an unpublished append wrote, leaving ``previous`` intact."""
        previous, appended = dp.resolve_ref(previous), dp.resolve_ref(appended)
        bundles = self._bundle_store
        for stage, stage_ref in appended.stage_refs.items():
            before = previous.stage_refs.get(stage)
            if before is None:
                self.remove_bundle(stage_ref)
                continue
            if before.manifest_key == stage_ref.manifest_key:
                continue
            old, new = bundles.resolve_manifest(before), bundles.resolve_manifest(stage_ref)
            keep = {before.manifest_key, *old.get("cleanup_keys", []),
                    *(k for spec in (old["meta"], *old["buffers"].values())
                      for k in bundles.payload_keys(spec))}
            owned = [*(k for spec in (new["meta"], *new["buffers"].values())
                       for k in bundles.payload_keys(spec)),
                     *new.get("cleanup_keys", []), bundles.manifest_key(stage_ref)]
            bundles.remove_keys([k for k in owned if k not in keep], strict=True)

    # -- internals: reading -------------------------------------------------------------

    def _stage_metadata(self, stage_ref: RemoteBundleRef) -> dict[str, Any]:
        return self._structured_store.read_metadata(
            self._bundle_store.resolve_manifest(stage_ref))

    def _get(self, ref: DataProtoRefLike, fields: Sequence[str] | None,
             batch_fields: Sequence[str] | None, non_tensor_fields: Sequence[str] | None,
             meta_info_keys: Sequence[str] | None, data_cls: Any,
             destinations: Mapping[str, Any] | None, rows: Any, flat: bool) -> Any:
        ref = dp.resolve_ref(ref)
        selection = dp.select_rows(rows, ref.batch_size)
        names = dp.select_fields(ref, fields, batch_fields, non_tensor_fields)
        destinations = destinations or {}
        values: dict[str, Any] = {}
        plain: dict[str, list[str]] = {}
        encoded: dict[str, list[str]] = {}
        for name in names:
            where = ref.field_index[name]
            coded = where.section == "non_tensor_batch" and name in ref.encoded_non_tensor
            (encoded if coded else plain).setdefault(where.stage, []).append(name)
        readers: dict[str, RowReader] = {}

        def reader(stage: str) -> RowReader:
            if stage not in readers:
                readers[stage] = RowReader(self._bundle_store, self._structured_store,
                                           self._transport, ref.stage_refs[stage])
            return readers[stage]

        for stage, stage_names in plain.items():
            members = {name: ref.field_index[name].member for name in stage_names}
            if selection is not None and selection.indices is not None:
                for name, member in members.items():
                    values[name] = reader(stage).member_rows(member, selection.indices,
                                                             destinations.get(name))
                continue
            spec = self.read_spec(ref.stage_refs[stage]).select_members(list(members.values()))
            if selection is not None:
                part = selection.rows
                for member in members.values():
                    spec = spec.slice_member(member, part.axis, part.start, part.end, part.step)
            result = self.materialize_into(spec, {members[n]: d for n, d in destinations.items()
                                                  if n in members})
            values.update({name: result.objects[member] for name, member in members.items()})
        for stage, stage_names in encoded.items():
            columns = {name: ref.encoded_non_tensor[name] for name in stage_names}
            if selection is None:
                wanted = [m for c in columns.values() for m in c["payload_members"].values()]
                objects = self.materialize(self.read_spec(ref.stage_refs[stage])
                                           .select_members(wanted)).objects
                for name, column in columns.items():
                    parts = {p: objects[m] for p, m in column["payload_members"].items()}
                    values[name] = decode_column(column, parts, ref.batch_size)
            else:
                indices = selection.indices if selection.indices is not None else \
                    range(*selection.rows.bounds(ref.batch_size))
                for name, column in columns.items():
                    parts, metadata = reader(stage).encoded_rows(column, list(indices))
                    values[name] = decode_column(column, parts, selection.count, metadata)
            if not flat:
                values.update({n: payloads.object_array(values[n]) for n in columns})
        batch = {n: values[n] for n in names if ref.field_index[n].section == "batch"}
        non_tensor = {n: values[n] for n in names
                      if ref.field_index[n].section == "non_tensor_batch"}
        meta = dict(ref.meta_info) if meta_info_keys is None else \
            {k: ref.meta_info[k] for k in meta_info_keys if k in ref.meta_info}
        return dp.build_result(batch, non_tensor, meta, data_cls)

    # -- internals: writing -------------------------------------------------------------

    def _encode_non_tensor(self, name: str, value: Any, schema: FieldSchema | None
                           ) -> EncodedColumn | None:
        """The encoded column for a non-tensor field, or None to store it as is."""
        if schema is not None:
            path = f"non_tensor_batch.{name}"
            try:
                column = dp.object_column(name, value)
                if schema.codec != "auto":
                    return encode_with_schema(path, column, schema)
                check_nullable(path, list(column), schema)
            except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
                raise type(exc)(f"failed to encode non_tensor_batch field {name!r} with "
                                f"FieldSchema codec {schema.codec!r}: {exc}") from exc
        if isinstance(value, np.ndarray) and value.dtype == object:
            return encode_inferred(f"non_tensor_batch.{name}", value)
        return None

    def _put_stage(self, ref: MooncakeDataProtoRef | None, data: Any, *, namespace: str,
                   partition: str, stage: str, chunk_bytes: int | None,
                   policy: BundleTransferPolicy | None, overwrite: bool,
                   schemas: Mapping[str, FieldSchema] | None, config: Any
                   ) -> MooncakeDataProtoRef:
        batch, non_tensor, meta_info = dp.split_sections(data)
        dp.check_schema_sections((batch, non_tensor, meta_info), schemas)
        batch_size = dp.batch_size_of(batch, non_tensor)
        if ref is not None and batch_size != ref.batch_size:
            raise ValueError(f"DataProto append batch size {batch_size} does not match ref "
                             f"batch size {ref.batch_size}")
        overlap = sorted(set(batch) & set(non_tensor))
        if overlap:
            raise ValueError(f"DataProto batch and non_tensor_batch fields overlap: {overlap}")
        members: dict[str, Any] = {}
        locations: dict[str, StructuredFieldLocation] = {}
        columns: dict[str, Any] = {}
        for name, value in batch.items():
            members[f"batch.{name}"] = value
            locations[name] = StructuredFieldLocation(stage, f"batch.{name}", "batch")
        for name, value in non_tensor.items():
            member = f"non_tensor_batch.{name}"
            locations[name] = StructuredFieldLocation(stage, member, "non_tensor_batch")
            column = self._encode_non_tensor(
                name, value, dp.schema_for(schemas, name, "non_tensor_batch"))
            if column is None:
                members[member] = value
                continue
            parts = {}
            for part, part_value in column.payload.items():
                members[f"{member}.{part}"] = part_value
                parts[part] = f"{member}.{part}"
            columns[name] = {"codec": column.codec, "rows": column.rows,
                             "metadata": column.metadata, "payload_members": parts}
        if not members:
            if ref is not None:
                return MooncakeDataProtoRef(
                    ref.batch_size, dict(ref.stage_refs), dict(ref.field_index),
                    {**ref.meta_info, **meta_info}, ref.namespace, ref.partition,
                    ref.global_indexes, dict(ref.encoded_non_tensor), ref._storage_group_id)
            return MooncakeDataProtoRef(batch_size, {}, {}, dict(meta_info), namespace,
                                        partition, None, {},
                                        writes.storage_group_for(config))
        if ref is not None:
            existing = sorted(set(ref.field_index) & set(locations))
            if existing and not overwrite:
                raise ValueError(f"DataProto fields already exist: {existing}")
            if overwrite:
                dangling = sorted(n for n, w in ref.field_index.items()
                                  if w.stage == stage and n not in locations)
                if dangling:
                    raise ValueError(f"DataProto overwrite for stage {stage!r} must include "
                                     f"existing fields: {dangling}")
        group = writes.storage_group_for(config) if ref is None else ref._storage_group_id
        effective = config if group is None else \
            writes.config_in_group(config, group, ReplicateConfig)
        payload = StructuredObjectPayload(
            {"layout": "dataproto_stage",
             "dataproto": {"version": 1, "namespace": namespace, "partition": partition,
                           "stage": stage, "batch_size": batch_size}}, members)
        previous = ref.stage_refs.get(stage) if ref is not None else None
        if previous is not None and not overwrite:
            stage_ref = self._append_to_stage(previous, payload, partition, chunk_bytes,
                                              policy, effective)
        else:
            stage_ref = self.put_structured_object(payload, partition, chunk_bytes, policy,
                                                   config=effective)
            if previous is not None and previous.manifest_key != stage_ref.manifest_key:
                self.remove_bundle(previous)
        if ref is None:
            return MooncakeDataProtoRef(batch_size, {stage: stage_ref}, locations,
                                        dict(meta_info), namespace, partition, None, columns,
                                        group)
        encoded = {n: c for n, c in ref.encoded_non_tensor.items() if n not in locations}
        encoded.update(columns)
        return MooncakeDataProtoRef(
            batch_size, {**ref.stage_refs, stage: stage_ref}, {**ref.field_index, **locations},
            {**ref.meta_info, **meta_info}, namespace, partition, ref.global_indexes, encoded,
            group)

    def _append_to_stage(self, old_ref: RemoteBundleRef, payload: StructuredObjectPayload,
                         partition: str, chunk_bytes: int | None,
                         policy: BundleTransferPolicy | None, config: Any) -> RemoteBundleRef:
        """Write ``payload`` as its own bundle, then a merged manifest over the old stage's
        and the new members; the temporary bundle's manifest and metadata are dropped."""
        bundles = self._bundle_store
        new_ref = self.put_structured_object(payload, partition, chunk_bytes, policy,
                                             config=config)
        try:
            old = bundles.resolve_manifest(old_ref)
            new = bundles.resolve_manifest(new_ref)
            metadata = merge_stage_metadata(self._structured_store.read_metadata(old),
                                            self._structured_store.read_metadata(new))
            clash = sorted(set(old["buffers"]) & set(new["buffers"]))
            if clash:
                raise ValueError(f"structured members already exist: {clash}")
            cleanup = [*old.get("cleanup_keys", []), bundles.manifest_key(old_ref),
                       *bundles.payload_keys(old["meta"]), bundles.manifest_key(new_ref),
                       *bundles.payload_keys(new["meta"])]
            merged = bundles.put_bundle_manifest(
                encode_metadata(metadata), {**old["buffers"], **new["buffers"]},
                partition=partition, chunk_bytes=chunk_bytes, policy=policy,
                cleanup_keys=cleanup, config=config)
        except Exception:
            self.remove_bundle(new_ref)
            raise
        bundles.remove_keys([bundles.manifest_key(new_ref), *bundles.payload_keys(new["meta"])],
                            strict=False)
        return merged
