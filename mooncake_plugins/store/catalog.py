"""A catalog mapping logical rows and fields onto immutable DataProto fragments.

A *fragment* is a DataProto ref handle (the JSON-safe dict ``mooncake_dataproto_ref``)
with exactly one stage; its stage's manifest key is the fragment's id. A partition holds
logical keys, each with a tag (a dict merged on every update) and, per field, the
``(fragment_id, row)`` that holds it. Writers add fragments with :meth:`update` (or the
idempotent :meth:`publish` / :meth:`publish_append`); readers turn ``(keys, fields)``
into fragment locations with :meth:`resolve`. All state is metadata: the catalog never
touches the store. Fragments added through ``publish`` are *managed*: once no key
refers to one and no pinned read holds it, its handle is listed in ``retired_handles``
until the caller removes the data and calls :meth:`ack_retired`.

Every call validates its arguments completely before changing anything, so a rejected
call leaves the catalog as it was. One instance is not thread-safe; its host serializes
calls.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HANDLE_TYPE = "mooncake_dataproto_ref"
HANDLE_VERSIONS = (1, 2)  # accepted on input; handles are written back as version 1
HANDLE_KIND = "bundle_stages"
SECTIONS = ("batch", "non_tensor_batch")

Location = tuple[str, int]  # (fragment id, row inside that fragment)


@dataclass(frozen=True)
class FragmentRef:
    """The parts of a validated DataProto handle the catalog reasons about."""

    batch_size: int
    partition: str
    stages: dict[str, str]  # stage name -> manifest key
    fields: dict[str, tuple[str, str, str]]  # field -> (stage, member, section)
    storage_group_id: str | None
    handle: dict[str, Any] = field(compare=False)  # canonical JSON-safe form


def normalize_handle(handle: Mapping[str, Any]) -> FragmentRef:
    """Validate a DataProto ref handle and return it with its canonical form."""
    if not isinstance(handle, Mapping) or handle.get("type") != HANDLE_TYPE:
        raise ValueError("not a Mooncake DataProto ref handle")
    version = handle.get("version")
    if isinstance(version, bool) or version not in HANDLE_VERSIONS:
        raise ValueError(f"unsupported DataProto ref handle version: {version!r}")
    if handle.get("kind") != HANDLE_KIND:
        raise ValueError(f"unsupported DataProto ref handle kind: {handle.get('kind')!r}")
    batch_size = handle.get("batch_size")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"DataProto ref handle batch_size must be an integer >= 0, "
                         f"got {batch_size!r}")

    stages: dict[str, str] = {}
    for stage, ref in _mapping(handle.get("stage_refs"), "stage_refs").items():
        key = _mapping(ref, f"stage_refs[{stage!r}]").get("manifest_key")
        if not _is_name(stage) or not _is_name(key):
            raise ValueError("DataProto ref handle stage names and manifest_key values "
                             "must be non-empty strings")
        stages[stage] = key

    fields: dict[str, tuple[str, str, str]] = {}
    for name, raw in _mapping(handle.get("field_index"), "field_index").items():
        where = _mapping(raw, f"field_index[{name!r}]")
        stage, member, section = where.get("stage"), where.get("member"), where.get("section")
        if section not in SECTIONS:
            raise ValueError(f"invalid DataProto field section: {section!r}")
        if not (_is_name(name) and _is_name(stage) and _is_name(member)):
            raise ValueError("DataProto ref handle field names, stages and members "
                             "must be non-empty strings")
        if stage not in stages:
            raise ValueError(f"DataProto field {name!r} references unknown stage {stage!r}")
        fields[name] = (stage, member, section)

    group = handle.get("storage_group_id")
    if (version == 2 and group is None) or (group is not None and not _is_name(group)):
        raise ValueError("DataProto ref handle has invalid storage_group_id")
    indexes = handle.get("global_indexes")
    if indexes is not None and (not isinstance(indexes, list) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in indexes)):
        raise ValueError("DataProto ref handle global_indexes must be a list of integers")
    partition = str(handle.get("partition", "default"))

    canonical: dict[str, Any] = {
        "type": HANDLE_TYPE,
        "version": HANDLE_VERSIONS[0],
        "kind": HANDLE_KIND,
        "batch_size": batch_size,
        "namespace": str(handle.get("namespace", "default")),
        "partition": partition,
        "global_indexes": None if indexes is None else list(indexes),
        "stage_refs": {stage: {"manifest_key": key} for stage, key in stages.items()},
        "field_index": {name: {"stage": s, "member": m, "section": sec}
                        for name, (s, m, sec) in fields.items()},
        "meta_info": _json_safe(_mapping(handle.get("meta_info", {}), "meta_info")),
        "encoded_non_tensor": _json_safe(
            _mapping(handle.get("encoded_non_tensor", {}), "encoded_non_tensor")),
    }
    if group is not None:
        canonical["storage_group_id"] = group
    json.dumps(canonical)
    return FragmentRef(batch_size, partition, stages, fields, group, canonical)


@dataclass
class _Row:
    tag: dict[str, Any]
    fields: dict[str, Location]


class DataProtoCatalog:
    """Logical ``(partition, key, field)`` -> immutable fragment location."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, _Row]] = {}
        self._fragments: dict[str, dict[str, Any]] = {}  # id -> canonical handle
        self._refs: dict[str, int] = {}  # id -> number of (key, field) pointing at it
        self._managed: set[str] = set()
        self._readers: dict[str, int] = {}  # id -> pinned reads holding it
        self._pins: dict[int, tuple[str, ...]] = {}
        self._last_token = 0
        self._retired: dict[str, dict[str, Any]] = {}
        self._publications: dict[str, dict[str, Any]] = {}
        self._drained = False

    # -- writes -------------------------------------------------------------------------

    def update(self, partition: str, keys: Sequence[str], *,
               tags: Sequence[Mapping[str, Any]] | None = None,
               handle: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Merge ``tags`` into the keys' tags and point them at ``handle``'s fields.

        Row ``i`` of the handle's fragment becomes ``keys[i]``; a field a key already
        had elsewhere is replaced. Returns the keys, their merged tags, the union of
        their fields and the pending ``retired_handles``.
        """
        return self._write(partition, keys, tags, handle, managed=False)

    def publish(self, operation_id: str, partition: str, keys: Sequence[str], *,
                tags: Sequence[Mapping[str, Any]] | None = None,
                handle: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """:meth:`update` with a managed fragment, once per ``operation_id``.

        A repeated ``operation_id`` returns the first call's result until
        :meth:`ack_publication` forgets it.
        """
        operation_id = _name(operation_id, "operation_id")
        if operation_id in self._publications:
            return copy.deepcopy(self._publications[operation_id])
        result = self._write(partition, keys, tags, handle, managed=handle is not None)
        self._publications[operation_id] = copy.deepcopy(result)
        return result

    def ack_publication(self, operation_id: str) -> None:
        """Forget a publication's result once its writer has seen it."""
        self._publications.pop(_name(operation_id, "operation_id"), None)

    def publish_append(self, operation_id: str, fragment_id: str, partition: str,
                       keys: Sequence[str], *, previous_handle: Mapping[str, Any],
                       handle: Mapping[str, Any]) -> dict[str, Any]:
        """Swap managed fragment ``fragment_id`` for ``handle``, its appended version.

        ``handle`` must keep the fragment's rows and existing fields and may add
        fields, which ``keys`` then point at. A stale or inconsistent append is not
        raised: it returns ``{"append_rejected": reason}`` so the writer can clean up
        the appended data. Idempotent per ``operation_id`` like :meth:`publish`.
        """
        operation_id = _name(operation_id, "operation_id")
        if operation_id in self._publications:
            return copy.deepcopy(self._publications[operation_id])
        result = self._append(fragment_id, partition, keys, previous_handle, handle)
        self._publications[operation_id] = copy.deepcopy(result)
        return result

    def remove(self, partition: str, keys: Sequence[str]) -> dict[str, Any]:
        """Drop logical keys (unknown ones are ignored); returns ``retired_handles``."""
        partition = _name(partition, "partition")
        keys = _names(keys, "keys")
        rows = self._rows.get(partition)
        if rows is not None:
            for key in keys:
                row = rows.pop(key, None)
                for fragment_id, _ in (row.fields.values() if row else ()):
                    self._release_ref(fragment_id)
            if not rows:
                del self._rows[partition]
        return self._retired_result()

    def drain(self) -> dict[str, Any]:
        """Forget everything, retiring every managed fragment; later writes fail."""
        if self._pins:
            raise RuntimeError(f"cannot drain DataProto catalog with "
                               f"{len(self._pins)} active read(s)")
        for fragment_id in self._managed:
            self._retired[fragment_id] = self._fragments[fragment_id]
        for state in (self._rows, self._fragments, self._refs, self._readers,
                      self._publications):
            state.clear()
        self._managed.clear()
        self._drained = True
        return self._retired_result()

    def ack_retired(self, handles: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Forget retired fragments whose data the caller has removed."""
        for given in handles:
            ref = normalize_handle(given)
            match = next((fid for fid, h in self._retired.items() if h == ref.handle), None)
            if match is not None:
                del self._retired[match]
            elif len(ref.stages) == 1 and next(iter(ref.stages.values())) in self._retired:
                raise ValueError(f"retired DataProto fragment mismatch: "
                                 f"{next(iter(ref.stages.values()))!r}")
        return self._retired_result()

    # -- reads --------------------------------------------------------------------------

    def resolve(self, partition: str, keys: Sequence[str],
                fields: Sequence[str] | None = None, *, pin: bool = False
                ) -> dict[str, Any]:
        """Where ``fields`` (default: all the keys have) of ``keys`` live, in order.

        ``field_groups`` gathers fields whose rows sit at the same locations, one
        ``(fragment_id, row)`` per key; ``handles`` maps each fragment id used to its
        handle and ``meta_info`` merges theirs. With ``pin`` the fragments stay alive
        (not retired) until :meth:`release_read` of the returned ``read_token``.
        """
        partition = _name(partition, "partition")
        keys = _names(keys, "keys")
        rows = self._rows.get(partition, {})
        missing = [key for key in keys if key not in rows]
        if missing:
            raise ValueError(f"keys were not found in partition {partition!r}: {missing}")
        selected = list(_names(fields, "field names")) if fields is not None \
            else _field_union(rows, keys)
        if not selected:
            raise ValueError("requested keys do not contain any fields")
        for key in keys:
            absent = [name for name in selected if name not in rows[key].fields]
            if absent:
                raise ValueError(f"fields are not ready for key {key!r}: {absent}")

        groups: dict[tuple[Location, ...], list[str]] = {}
        for name in selected:
            groups.setdefault(tuple(rows[key].fields[name] for key in keys), []).append(name)
        used = list(dict.fromkeys(fid for locations in groups for fid, _ in locations))
        handles = {fid: copy.deepcopy(self._fragments[fid]) for fid in used}
        meta_info: dict[str, Any] = {}
        for handle in handles.values():
            for name, value in handle["meta_info"].items():
                if name in meta_info and meta_info[name] != value:
                    raise ValueError(f"conflicting DataProto meta_info value for {name!r}")
                meta_info[name] = copy.deepcopy(value)

        result: dict[str, Any] = {
            "keys": list(keys),
            "tags": [copy.deepcopy(rows[key].tag) for key in keys],
            "fields": selected,
            "field_groups": [{"fields": names, "locations": list(locations)}
                             for locations, names in groups.items()],
            "handles": handles,
            "meta_info": meta_info,
        }
        if pin:
            self._last_token += 1
            self._pins[self._last_token] = tuple(used)
            for fid in used:
                self._readers[fid] = self._readers.get(fid, 0) + 1
            result["read_token"] = self._last_token
        return result

    def release_read(self, token: int) -> dict[str, Any]:
        """End a pinned read (again is a no-op); returns ``retired_handles``."""
        for fid in self._pins.pop(token, ()):
            self._readers[fid] -= 1
            if not self._readers[fid]:
                del self._readers[fid]
                if fid not in self._refs:
                    self._retire(fid)
        return self._retired_result()

    def list(self, partition: str | None = None) -> dict[str, dict[str, Any]]:
        """``{partition: {key: tag}}`` for one partition (if it exists) or all."""
        if partition is not None:
            partition = _name(partition, "partition")
            names = [partition] if partition in self._rows else []
        else:
            names = list(self._rows)
        return {name: {key: copy.deepcopy(row.tag) for key, row in self._rows[name].items()}
                for name in names}

    # -- internals ----------------------------------------------------------------------

    def _write(self, partition: str, keys: Sequence[str],
               tags: Sequence[Mapping[str, Any]] | None,
               handle: Mapping[str, Any] | None, *, managed: bool) -> dict[str, Any]:
        if self._drained:
            raise RuntimeError("DataProto catalog is drained")
        partition = _name(partition, "partition")
        keys = _names(keys, "keys")
        new_tags = _tags(tags, len(keys))
        if new_tags is None and handle is None:
            raise ValueError("catalog update requires tags or a DataProto handle")
        fragment = None if handle is None else self._check_fragment(handle, len(keys),
                                                                    managed)
        rows = self._rows.setdefault(partition, {})
        if fragment is not None:
            fid, ref = fragment
            self._fragments.setdefault(fid, ref.handle)
            self._refs.setdefault(fid, 0)
            if managed:
                self._managed.add(fid)
        for index, key in enumerate(keys):
            row = rows.setdefault(key, _Row({}, {}))
            if new_tags is not None:
                row.tag.update(new_tags[index])
            if fragment is not None:
                for name in fragment[1].fields:
                    self._point(row, name, (fragment[0], index))
        return self._row_result(rows, keys)

    def _check_fragment(self, handle: Mapping[str, Any], batch_size: int,
                        managed: bool) -> tuple[str, FragmentRef]:
        ref = normalize_handle(handle)
        if len(ref.stages) != 1:
            raise ValueError("catalog fragments must contain exactly one DataProto stage")
        fid = next(iter(ref.stages.values()))
        if ref.batch_size != batch_size:
            raise ValueError(f"DataProto batch size {ref.batch_size} does not match "
                             f"{batch_size} logical keys")
        if not ref.fields:
            raise ValueError("DataProto catalog fragments cannot be empty")
        known = self._fragments.get(fid)
        if known is not None and known != ref.handle:
            raise ValueError(f"DataProto fragment id collision: {fid!r}")
        if known is not None and (fid in self._managed) != managed:
            raise ValueError(f"DataProto fragment management mismatch: {fid!r}")
        if fid in self._retired:
            raise ValueError(f"DataProto fragment id is pending retirement: {fid!r}")
        return fid, ref

    def _append(self, fragment_id: str, partition: str, keys: Sequence[str],
                previous_handle: Mapping[str, Any], handle: Mapping[str, Any]
                ) -> dict[str, Any]:
        if self._drained:
            return {"append_rejected": "DataProto catalog is drained"}
        fragment_id = _name(fragment_id, "fragment_id")
        partition = _name(partition, "partition")
        keys = _names(keys, "keys")
        old, new = normalize_handle(previous_handle), normalize_handle(handle)
        if fragment_id not in self._managed or self._fragments.get(fragment_id) != old.handle:
            return {"append_rejected": f"stale DataProto append handle: {fragment_id!r}"}
        if (new.batch_size, new.partition, new.storage_group_id) != \
                (old.batch_size, old.partition, old.storage_group_id) \
                or new.batch_size != len(keys) or new.partition != partition:
            return {"append_rejected": "appended DataProto handle changed fragment identity"}
        if any(new.fields.get(name) != where for name, where in old.fields.items()):
            return {"append_rejected": "appended DataProto handle changed existing fields"}
        rows = self._rows.get(partition, {})
        missing = [key for key in keys if key not in rows]
        if missing:
            return {"append_rejected":
                    f"keys not found in partition {partition!r}: {missing}"}
        added = [name for name in new.fields if name not in old.fields]
        for index, key in enumerate(keys):
            for name in added:
                self._point(rows[key], name, (fragment_id, index))
        self._fragments[fragment_id] = new.handle
        return self._row_result(rows, keys)

    def _point(self, row: _Row, name: str, location: Location) -> None:
        """Make ``row``'s field ``name`` live at ``location``, keeping refcounts."""
        previous = row.fields.get(name)
        row.fields[name] = location
        if previous is not None and previous[0] == location[0]:
            return
        if previous is not None:
            self._release_ref(previous[0])
        self._refs[location[0]] += 1

    def _release_ref(self, fid: str) -> None:
        self._refs[fid] -= 1
        if self._refs[fid]:
            return
        del self._refs[fid]
        if not self._readers.get(fid):
            self._retire(fid)

    def _retire(self, fid: str) -> None:
        handle = self._fragments.pop(fid)
        if fid in self._managed:
            self._managed.discard(fid)
            self._retired[fid] = handle

    def _row_result(self, rows: Mapping[str, _Row], keys: Sequence[str]) -> dict[str, Any]:
        return {"keys": list(keys),
                "tags": [copy.deepcopy(rows[key].tag) for key in keys],
                "fields": _field_union(rows, keys),
                **self._retired_result()}

    def _retired_result(self) -> dict[str, Any]:
        return {"retired_handles": [copy.deepcopy(h) for h in self._retired.values()]}


def _field_union(rows: Mapping[str, _Row], keys: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(name for key in keys for name in rows[key].fields))


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _name(value: Any, label: str) -> str:
    if not _is_name(value):
        raise ValueError(f"{label} must be a non-empty string")
    return value


def _names(values: Any, label: str) -> tuple[str, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, Mapping)):
        raise ValueError(f"{label} must be a sequence of non-empty strings, "
                         f"got {type(values).__name__}")
    names = tuple(values)
    if not names or not all(_is_name(name) for name in names):
        raise ValueError(f"{label} must be a non-empty sequence of non-empty strings")
    if len(set(names)) != len(names):
        raise ValueError(f"{label} must be unique")
    return names


def _tags(tags: Sequence[Mapping[str, Any]] | None, count: int
          ) -> list[dict[str, Any]] | None:
    if tags is None:
        return None
    if isinstance(tags, (str, bytes, Mapping)) or not isinstance(tags, Sequence):
        raise ValueError("tags must be a sequence of mappings")
    if len(tags) != count:
        raise ValueError(f"tags must have the same length as keys ({len(tags)} != {count})")
    if not all(isinstance(tag, Mapping) for tag in tags):
        raise TypeError("tags must be mappings")
    return [copy.deepcopy(dict(tag)) for tag in tags]


def _mapping(value: Any, label: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"DataProto ref handle {label} must be a mapping")
    return value


def _json_safe(value: Any) -> Any:
    """A JSON-safe deep copy; numpy scalars and arrays become Python values."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return _json_safe(value.tolist())
    raise TypeError(f"DataProto ref handles hold only JSON-safe values, "
                    f"got {type(value).__name__}")
