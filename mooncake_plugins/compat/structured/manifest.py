"""Bundles: a metadata blob plus named payloads, found through one JSON manifest object.

Key layout under ``<prefix>/<partition>/<uuid>`` (the bundle's *object id* is
``<partition>/<uuid>``)::

    .../manifest              the manifest (JSON)
    .../meta[/chunk/<i>]      the metadata blob
    .../buffer/<name>[/chunk/<i>]

The manifest (the original's format)::

    {"version": 1, "layout": "bundle", "object_id": ..., "meta": <payload spec>,
     "buffers": {name: <payload spec>},
     "buffer_object_ids": [...], "cleanup_keys": [...]}   # merged manifests only

A merged manifest (an appended DataProto stage) may point at payloads of earlier bundles
(``buffer_object_ids``) and lists the earlier objects it supersedes (``cleanup_keys``) so
that removing it removes them too. Every manifest read is validated: a payload or cleanup
key outside the bundles it names is refused, so a tampered manifest cannot make a reader
fetch, or a remover delete, unrelated objects.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import payloads, tensor_codec, writes
from .payloads import (DirectCopyPayload, MultiBufferPayload, TensorObjectBuffer,
                       TensorPayload, bytes_view, group_buffers, split_view)
from .records import AUTO_PARALLEL_MIN_BYTES, AUTO_PARALLEL_MIN_CHUNKS, \
    BundleTransferPolicy, RemoteBundleRef
from .transport import PayloadTransport

MANIFEST_VERSION = 1


def encode_json(value: Mapping[str, Any], label: str) -> bytes:
    """Compact JSON of a dict (TypeError naming ``label`` if it is not serializable)."""
    try:
        return json.dumps(value, separators=(",", ":")).encode("utf-8")
    except TypeError as exc:
        raise TypeError(f"{label} must be JSON-serializable") from exc


def decode_json(payload: bytes, label: str) -> dict[str, Any]:
    value = json.loads(bytes(payload).decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{label} must decode to a dict")
    return value


def encode_manifest(manifest: Mapping[str, Any]) -> bytes:
    return encode_json(manifest, "bundle manifest")


def decode_manifest(payload: bytes) -> dict[str, Any]:
    return decode_json(payload, "bundle manifest")


def check_segment(value: Any, name: str) -> None:
    """A key segment: a non-empty string without ``/`` or control characters."""
    if not isinstance(value, str) or not value or "/" in value \
            or any(ord(c) < 32 for c in value):
        raise ValueError(f"invalid bundle {name}: {value!r}")


def check_chunk_bytes(chunk_bytes: int) -> int:
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    return chunk_bytes


def normalize_prefix(prefix: str) -> str:
    cleaned = prefix.strip("/")
    if not cleaned or any(ord(c) < 32 for c in cleaned):
        raise ValueError("key_prefix must be a non-empty key prefix")
    return cleaned


def _spec(key: str, chunk_keys: Sequence[str], sizes: Sequence[int]) -> dict[str, Any]:
    return {"key": key, "bytes": int(sum(sizes)),
            "chunks": [{"key": k, "bytes": int(n)} for k, n in zip(chunk_keys, sizes)]}


def _chunk_keys(key: str, count: int) -> list[str]:
    return [key] if count == 1 else [f"{key}/chunk/{i}" for i in range(count)]


def payload_keys(spec: Mapping[str, Any]) -> list[str]:
    """The store keys holding one payload."""
    return [chunk["key"] for chunk in spec["chunks"]]


class BundleManifestStore:
    """Writes, validates, resolves and removes bundles under one key prefix."""

    def __init__(self, store: Any, transport: PayloadTransport, key_prefix: str,
                 default_chunk_bytes: int, config_factory: Any = None) -> None:
        self._store = store
        self._transport = transport
        self._prefix = key_prefix
        self._default_chunk_bytes = default_chunk_bytes
        self.config_factory = config_factory

    # -- writing ------------------------------------------------------------------------

    def _new_bundle(self, partition: str, meta: Any, chunk_bytes: int | None,
                    policy: BundleTransferPolicy | None, max_inflight_put: int | None
                    ) -> tuple[memoryview, int, BundleTransferPolicy, str, str]:
        """A new bundle's checked inputs: (meta's bytes, chunk size, policy, object id,
        key base)."""
        check_segment(partition, "partition")
        meta_view = bytes_view(meta, "meta")
        chunk = check_chunk_bytes(self._default_chunk_bytes if chunk_bytes is None
                                  else chunk_bytes)
        policy = (policy or BundleTransferPolicy()).validated(max_inflight_put)
        object_id = f"{partition}/{uuid.uuid4().hex}"
        return meta_view, chunk, policy, object_id, f"{self._prefix}/{object_id}"

    def put_bundle(self, meta: Any, buffers: Mapping[str, Any], partition: str = "default",
                   chunk_bytes: int | None = None, policy: BundleTransferPolicy | None = None,
                   max_inflight_put: int | None = None, config: Any = None
                   ) -> RemoteBundleRef:
        """Write ``meta`` and every buffer, then the manifest; on any failure everything
        written is removed and the error raised."""
        meta_view, chunk, policy, object_id, base = self._new_bundle(
            partition, meta, chunk_bytes, policy, max_inflight_put)
        written: list[str] = []
        try:
            meta_spec = self._put_bytes(f"{base}/meta", meta_view, chunk, policy.as_copy(),
                                        config, written)
            specs: dict[str, Any] = {}
            for name, value in buffers.items():
                check_segment(name, "buffer name")
                specs[name] = self._put_member(f"{base}/buffer/{name}", value, chunk, policy,
                                               config, written)
            manifest = {"version": MANIFEST_VERSION, "layout": "bundle",
                        "object_id": object_id, "meta": meta_spec, "buffers": specs}
            self._write_manifest(f"{base}/manifest", manifest, config, written)
        except Exception:
            writes.remove_keys(self._store, written, strict=False)
            raise
        return RemoteBundleRef(f"{base}/manifest", manifest)

    def put_bundle_manifest(self, meta: Any, buffers: Mapping[str, Any], *, partition: str,
                            chunk_bytes: int | None, policy: BundleTransferPolicy | None,
                            cleanup_keys: Sequence[str] | None = None, config: Any = None
                            ) -> RemoteBundleRef:
        """A new bundle with fresh ``meta`` over payloads already stored (``buffers`` are
        payload specs, possibly of other bundles); it owns ``cleanup_keys`` too."""
        meta_view, chunk, policy, object_id, base = self._new_bundle(
            partition, meta, chunk_bytes, policy, None)
        written: list[str] = []
        try:
            meta_spec = self._put_bytes(f"{base}/meta", meta_view, chunk, policy.as_copy(),
                                        config, written)
            cleanup = list(dict.fromkeys(cleanup_keys or []))
            owners = {self._object_id_of(str(spec["key"])) for spec in buffers.values()}
            owners.update(self._object_id_of(key) for key in cleanup)
            manifest: dict[str, Any] = {
                "version": MANIFEST_VERSION, "layout": "bundle", "object_id": object_id,
                "meta": meta_spec, "buffers": dict(buffers),
                "buffer_object_ids": sorted(o for o in owners if o)}
            if cleanup:
                manifest["cleanup_keys"] = cleanup
            self.validate(manifest)
            self._write_manifest(f"{base}/manifest", manifest, config, written)
        except Exception:
            writes.remove_keys(self._store, written, strict=False)
            raise
        return RemoteBundleRef(f"{base}/manifest", manifest)

    def _write_manifest(self, key: str, manifest: Mapping[str, Any], config: Any,
                        written: list[str]) -> None:
        writes.check_status(writes.put(self._store, key, encode_manifest(manifest), config),
                            "put", key)
        written.append(key)

    def _put_member(self, key: str, value: Any, chunk: int, policy: BundleTransferPolicy,
                    config: Any, written: list[str]) -> dict[str, Any]:
        if isinstance(value, (TensorPayload, TensorObjectBuffer)):
            return self._put_tensor(key, value, policy, config, written)
        if isinstance(value, MultiBufferPayload):
            return self._put_buffers(key, value.buffers, chunk, policy, config, written)
        if isinstance(value, DirectCopyPayload):
            spec = self._put_direct_copy_payload(key, value, chunk, policy, config)
            written.extend(payload_keys(spec))
            return spec
        return self._put_bytes(key, bytes_view(value, key.rsplit("/", 1)[-1]), chunk, policy,
                               config, written)

    def _put_bytes(self, key: str, view: memoryview, chunk: int,
                   policy: BundleTransferPolicy, config: Any,
                   written: list[str]) -> dict[str, Any]:
        return self._put_buffers(key, (view,), chunk, policy, config, written)

    def _put_buffers(self, key: str, buffers: Sequence[memoryview], chunk: int,
                     policy: BundleTransferPolicy, config: Any,
                     written: list[str]) -> dict[str, Any]:
        views = [bytes_view(b, "payload part") for b in buffers]
        views = [v for v in views if len(v)]
        if not views:
            return _spec(key, [], [])
        groups = ([[piece] for piece in split_view(views[0], chunk)] if len(views) == 1
                  else group_buffers(views, chunk))
        keys = _chunk_keys(key, len(groups))
        self._transport.put_chunks(keys, groups, policy, config)
        written.extend(keys)
        return _spec(key, keys, [sum(len(b) for b in g) for g in groups])

    def _put_tensor(self, key: str, value: TensorPayload | TensorObjectBuffer,
                    policy: BundleTransferPolicy, config: Any,
                    written: list[str]) -> dict[str, Any]:
        if isinstance(value, TensorObjectBuffer):
            total = self._transport.put_tensor_object(key, value, config)
            written.append(key)
            return _spec(key, [key], [total])
        if policy.copy_mode == "zero_copy":
            raise ValueError("zero-copy structured tensor fields require a BufferPool "
                             "tensor-object buffer")
        if policy.copy_mode != "copy":
            spec = self._transport.put_tensor(key, value, config)
            if spec is None:
                total = self._transport.put_tensor_through_pool(key, value, config)
                spec = None if total is None else _spec(key, [key], [total])
            if spec is not None:
                written.append(key)
                return spec
        tensor = value.tensor
        if not tensor_codec.has_tensor_codec() or tensor.dim() == 0:
            blob = tensor_codec.torch_save_bytes(tensor)
            spec = self._put_bytes(key, memoryview(blob), len(blob) or 1, policy, config,
                                   written)
            spec["format"] = "torch_save"
            return spec
        blob, header = tensor_codec.to_bytes(tensor)
        spec = self._put_bytes(key, memoryview(blob), len(blob), policy, config, written)
        spec["metadata_bytes"] = header
        return spec

    def _put_direct_copy_payload(self, key: str, value: DirectCopyPayload,
                                 chunk_bytes: int, transfer_policy: BundleTransferPolicy,
                                 config: Any = None) -> dict[str, Any]:
        """Write arrays gathered straight into pool leases, one lease per chunk.

        A chunk never splits an array; without a pool, ``batch_put_from``, or with an
        array larger than a chunk, the arrays are concatenated and written as bytes.
        On failure all chunk keys are removed.
        """
        if transfer_policy.copy_mode == "zero_copy":
            raise RuntimeError("zero-copy put requires tensor-object buffers")
        arrays = value.arrays
        if value.total_bytes == 0:
            return _spec(key, [], [])
        pool = self._transport.buffer_pool()
        put_from = self._transport.batch_put_from_fn
        if (len(arrays) == 1 or pool is None or not callable(put_from)
                or payloads.concat_arrays_into is None
                or any(a.nbytes > chunk_bytes for a in arrays)):
            joined = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                                     for a in arrays])
            written: list[str] = []
            return self._put_bytes(key, memoryview(joined), chunk_bytes, transfer_policy,
                                   config, written)
        batches: list[tuple[int, int, int]] = []      # (first array, count, bytes)
        start, size = 0, 0
        for index, array in enumerate(arrays):
            if size and size + array.nbytes > chunk_bytes:
                batches.append((start, index - start, size))
                start, size = index, 0
            size += array.nbytes
        batches.append((start, len(arrays) - start, size))
        keys = _chunk_keys(key, len(batches))

        def put_batches(batch_keys: Sequence[str], parts: Sequence[tuple[int, int, int]]) -> None:
            for chunk_key, (first, count, nbytes) in zip(batch_keys, parts):
                lease = pool.acquire(nbytes)
                try:
                    copied = payloads.concat_arrays_into(arrays, lease.ptr, nbytes, first, count)
                    if copied != nbytes:
                        raise RuntimeError(f"native fast-copy wrote {copied} bytes, expected "
                                           f"{nbytes}")
                    results = writes.batch_put_from(put_from, [chunk_key], [lease.ptr],
                                                    [nbytes], config)
                    writes.check_results(results, [chunk_key], "batch_put_from")
                finally:
                    lease.release()

        parallel = (transfer_policy.put_mode != "batch" and transfer_policy.max_inflight_put > 1
                    and len(batches) >= AUTO_PARALLEL_MIN_CHUNKS
                    and value.total_bytes >= AUTO_PARALLEL_MIN_BYTES)
        try:
            if not parallel:
                put_batches(keys, batches)
            else:
                from concurrent.futures import ThreadPoolExecutor
                per = -(-len(batches) // min(transfer_policy.max_inflight_put, len(batches)))
                with ThreadPoolExecutor(max_workers=-(-len(batches) // per)) as executor:
                    futures = [executor.submit(put_batches, keys[i:i + per], batches[i:i + per])
                               for i in range(0, len(batches), per)]
                    for future in futures:
                        future.result()
        except Exception:
            writes.remove_keys(self._store, keys, strict=False)
            raise
        return _spec(key, keys, [b[2] for b in batches])

    # -- reading and removing -----------------------------------------------------------

    def resolve_manifest(self, ref: RemoteBundleRef | Mapping[str, Any]) -> dict[str, Any]:
        """The validated manifest of ``ref`` (fetched when the ref does not carry it)."""
        if isinstance(ref, RemoteBundleRef):
            manifest = ref.manifest or decode_manifest(self._store.get(ref.manifest_key))
        else:
            manifest = ref.get("manifest")
            if manifest is None:
                key = ref.get("manifest_key")
                if not isinstance(key, str):
                    raise ValueError("bundle ref must include manifest_key")
                manifest = decode_manifest(self._store.get(key))
        self.validate(manifest)
        return manifest

    def manifest_key(self, ref: RemoteBundleRef | Mapping[str, Any]) -> str:
        return self._manifest_key(ref, self.resolve_manifest(ref))

    def payload_keys(self, spec: Mapping[str, Any]) -> list[str]:
        return payload_keys(spec)

    def remove_keys(self, keys: Sequence[str], *, strict: bool) -> None:
        writes.remove_keys(self._store, keys, strict)

    def remove_bundle(self, ref: RemoteBundleRef | Mapping[str, Any]) -> None:
        """Remove the bundle's payloads, the objects it supersedes and its manifest."""
        manifest = self.resolve_manifest(ref)
        keys = [key for spec in (manifest["meta"], *manifest["buffers"].values())
                for key in payload_keys(spec)]
        keys.extend(manifest.get("cleanup_keys", []))
        keys.append(self._manifest_key(ref, manifest))
        writes.remove_keys(self._store, keys, strict=True)

    def _manifest_key(self, ref: RemoteBundleRef | Mapping[str, Any],
                      manifest: Mapping[str, Any]) -> str:
        expected = f"{self._prefix}/{manifest['object_id']}/manifest"
        given = ref.manifest_key if isinstance(ref, RemoteBundleRef) else ref.get("manifest_key")
        if given is None:
            return expected
        if given != expected:
            raise ValueError("bundle manifest_key does not match manifest object_id")
        return given

    def _object_id_of(self, key: str) -> str | None:
        """The object id of a key of one of this prefix's bundles."""
        head = f"{self._prefix}/"
        if not key.startswith(head):
            return None
        rest = key[len(head):]
        for suffix in ("/manifest", "/meta"):
            if rest.endswith(suffix):
                return rest[:-len(suffix)]
        for marker in ("/meta/", "/buffer/"):
            at = rest.find(marker)
            if at > 0:
                return rest[:at]
        return None

    def validate(self, manifest: Any) -> None:
        """Raise ValueError unless ``manifest`` is well formed and every key it names
        belongs to the bundles it declares."""
        if not isinstance(manifest, Mapping) or manifest.get("version") != MANIFEST_VERSION \
                or manifest.get("layout") != "bundle":
            raise ValueError("invalid bundle manifest")
        object_id = manifest.get("object_id")
        if not isinstance(object_id, str):
            raise ValueError("bundle manifest object_id must be a string")
        owners = manifest.get("buffer_object_ids", [object_id])
        if not isinstance(owners, list) or not all(isinstance(o, str) for o in owners):
            raise ValueError("bundle manifest buffer_object_ids must be a list of strings")
        bases = [f"{self._prefix}/{o}" for o in owners]
        _check_payload(manifest.get("meta"), [f"{self._prefix}/{object_id}"])
        cleanup = manifest.get("cleanup_keys", [])
        if not isinstance(cleanup, list) or not all(
                isinstance(k, str) and any(k == f"{b}/manifest" or k.startswith(f"{b}/")
                                           for b in bases) for k in cleanup):
            raise ValueError("bundle manifest cleanup_keys are outside the bundle namespace")
        buffers = manifest.get("buffers")
        if not isinstance(buffers, dict):
            raise ValueError("bundle manifest buffers must be a dict")
        for name, spec in buffers.items():
            check_segment(name, "buffer name")
            _check_payload(spec, bases)


def _check_payload(spec: Any, bases: Sequence[str]) -> None:
    if not isinstance(spec, dict):
        raise ValueError("bundle payload spec must be a dict")
    key = spec.get("key")
    if not isinstance(key, str) or not any(key.startswith(f"{b}/") for b in bases):
        raise ValueError("bundle payload key is outside the bundle namespace")
    total = _int(spec.get("bytes", -1))
    if total < 0:
        raise ValueError("bundle payload bytes must be non-negative")
    chunks = spec.get("chunks")
    if not isinstance(chunks, list) or (total and not chunks):
        raise ValueError("bundle payload chunks are invalid")
    seen: set[str] = set()
    covered = 0
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise ValueError("bundle chunk must be a dict")
        ckey, size = chunk.get("key"), _int(chunk.get("bytes", -1))
        if not isinstance(ckey, str) or (ckey != key and not ckey.startswith(f"{key}/")):
            raise ValueError("bundle chunk key is outside the payload namespace")
        if ckey in seen:
            raise ValueError("bundle chunk keys must be unique")
        if size < 0:
            raise ValueError("bundle chunk bytes must be non-negative")
        seen.add(ckey)
        covered += size
    if covered != total:
        raise ValueError(f"bundle payload chunks total {covered} bytes, expected {total}")


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"bundle byte counts must be integers, got {value!r}")
    return value
