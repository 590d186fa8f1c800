"""The master's admin HTTP API, served with ``/metrics`` on ``--metrics_port`` as the original.

The original's routes (upstream ``master_admin_service.cpp``), with its reply shapes and
status codes:

- ``GET /query_key?key=K``: ``{"success": true, "data": [descriptor, ...]}`` (its memory
  replicas), 404 with the original's error body when absent.
- ``GET /batch_query_keys?keys=a,b``: ``{"success": true, "data": {key: {"ok": true,
  "values": [...], "disk_values": [...]} | {"ok": false, "error": "OBJECT_NOT_FOUND"}}}``;
  400 without keys.
- ``GET /get_all_keys``, ``GET /get_all_segments``: one name per line (streamed).
- ``GET /get_segments_detail``: ``{"total_segments": n, "segments": [...]}``.
- ``GET /query_segment?segment=S``: ``S\nUsed(bytes): u\nCapacity(bytes) : c\n``.
- ``GET /role`` (``leader`` / ``standby``), ``GET /ha_status`` (``starting``,
  ``candidate``, ``recovering``, ``serving``, ``standby``), ``GET /leader``
  (``{"present": ..., "leader_address": ..., "view_version": <term>}``; a master
  without --enable_ha has no published leader), ``GET /metrics/summary`` (one line).
- ``GET /kv_events/status``: the KV event publisher's counters.
- ``POST /api/v1/remove_all?force=true``: ``{"success": true, "removed_count": n}``.
- ``POST /api/v1/drain_jobs`` ``{"segments": [...], "target_segments": [...],
  "max_concurrency": n}``, ``GET /api/v1/drain_jobs/query?job_id=...``,
  ``POST /api/v1/drain_jobs/cancel?job_id=...``, ``GET /api/v1/segments/status?segment=...``.
- ``GET /health``: ``OK`` while the process runs.

Every other path answers the Prometheus metrics (``metrics.py``). A failure replies
``{"success": false, "error_code": <the original's code>, "error_message": ...}``; a
bad query (a parameter missing or malformed) is a 400 with the reason; the routes that
read the store answer 503 until this master serves (a candidate, or one recovering).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterable, Iterator, Protocol
from urllib.parse import parse_qs

from ..errors import InvalidParams, MooncakeError, StoreError
from .kv_events import KvEventPublisher
from .master import MasterService

log = logging.getLogger(__name__)

MAX_BODY_NBYTES = 1 << 20
MAX_QUERY_KEYS = 10_000      # keys of one /batch_query_keys
STREAM_CHUNK_NBYTES = 64 << 10
UNAVAILABLE_IN_CURRENT_MODE = -1011
NOT_FOUND = "OBJECT_NOT_FOUND"     # the original's name of error -704
PROTOCOL = "tcp"                   # what a descriptor names: every holder serves tcp

_HTTP_STATUS = {-600: "400 Bad Request", -1010: "409 Conflict", -1402: "404 Not Found",
                -101: "404 Not Found"}
_JSON = "application/json; charset=utf-8"
_TEXT = "text/plain; version=0.0.4"      # the original's type for its text answers
_PLAIN = "text/plain; charset=utf-8"

WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


class AdminHost(Protocol):
    """What the admin API reads beside the service: the master process (server.py)."""

    service: MasterService
    events: KvEventPublisher | None

    def ha_state(self) -> str: ...

    def leader(self) -> tuple[str, int] | None: ...

    def remove_all(self, force: bool) -> int: ...


class _Reply(Exception):
    """Answer at once with this status and JSON payload."""

    def __init__(self, status: str, payload: dict) -> None:
        super().__init__(status)
        self.status, self.payload = status, payload


def _reply(start: Callable, status: str, payload: dict) -> list[bytes]:
    return _send(start, status, _JSON, json.dumps(payload).encode())


def _send(start: Callable, status: str, content_type: str, body: bytes) -> list[bytes]:
    start(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]


def _stream(start: Callable, lines: list[str]) -> Iterator[bytes]:
    """``lines``, one per line, in chunks (no length: the connection's end ends it)."""
    start("200 OK", [("Content-Type", _TEXT)])
    chunk: list[str] = []
    size = 0
    for line in lines:
        chunk.append(line)
        size += len(line) + 1
        if size >= STREAM_CHUNK_NBYTES:
            yield ("\n".join(chunk) + "\n").encode()
            chunk, size = [], 0
    if chunk:
        yield ("\n".join(chunk) + "\n").encode()


def _body(environ: dict) -> dict:
    try:
        n = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise InvalidParams("bad Content-Length") from None
    if not 0 <= n <= MAX_BODY_NBYTES:
        raise InvalidParams(f"the body must be at most {MAX_BODY_NBYTES} bytes")
    try:
        doc = json.loads(environ["wsgi.input"].read(n) or b"{}")
    except ValueError as exc:
        raise InvalidParams(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise InvalidParams("invalid JSON body: nested too deeply") from None
    if not isinstance(doc, dict):
        raise InvalidParams("the body must be a JSON object")
    return doc


def _strings(doc: dict, name: str) -> list[str]:
    value = doc.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidParams(f"{name} must be a list of strings")
    return value


def _query(environ: dict, name: str) -> str:
    value = _optional(environ, name)
    if not value:
        raise InvalidParams(f"missing query parameter {name!r}")
    return value


def _optional(environ: dict, name: str) -> str:
    try:
        values = parse_qs(environ.get("QUERY_STRING", ""), errors="strict").get(name, [""])
    except UnicodeDecodeError:
        raise InvalidParams("the query string is not UTF-8") from None
    return values[0]


def _descriptors(replicas: list[list]) -> list[dict]:
    """The original's buffer descriptors of memory replicas: one per shard."""
    return [{"size_": n, "buffer_address_": address, "protocol_": PROTOCOL,
             "transport_endpoint_": segment}
            for replica in replicas for segment, address, n in replica]


def admin_app(host: AdminHost, metrics_app: WsgiApp) -> WsgiApp:
    """A WSGI app: the admin routes of ``host``, everything else to ``metrics_app``."""
    service = host.service

    def serving() -> None:
        if host.ha_state() != "serving":
            raise _Reply("503 Service Unavailable", {
                "success": False, "error_code": UNAVAILABLE_IN_CURRENT_MODE,
                "error_message": "service plane is not active"})

    # -- JSON routes: the payload gets "success": true ---------------------------------
    def create(environ: dict) -> dict:
        doc = _body(environ)
        concurrency = doc.get("max_concurrency", 4)
        if not isinstance(concurrency, int) or isinstance(concurrency, bool):
            raise InvalidParams("max_concurrency must be an integer")
        job_id = service.create_drain_job(_strings(doc, "segments"),
                                          _strings(doc, "target_segments"), concurrency)
        return {"job_id": job_id, "status": "CREATED"}

    def cancel(environ: dict) -> dict:
        job_id = _query(environ, "job_id")
        service.cancel_drain_job(job_id)
        return {"job_id": job_id, "status": "CANCELED"}

    def segment(environ: dict) -> dict:
        name = _query(environ, "segment")
        status = service.segment_status(name)
        return {"segment": name, "status": ("OK", "DRAINING", "DRAINED").index(status) + 1,
                "status_name": status}

    def query_key(environ: dict) -> dict:
        key = _query(environ, "key")
        serving()
        found = service.describe([key])[0]
        if found is None:
            raise _Reply("404 Not Found", {"success": False, "error_code": -704,
                                           "error_message": NOT_FOUND})
        return {"data": _descriptors(found["replicas"])}

    def batch_query_keys(environ: dict) -> dict:
        text = _optional(environ, "keys")
        keys = text.split(",") if text else []
        if not keys:
            raise _Reply("400 Bad Request", {"success": False,
                                             "error": "No keys provided. Use ?keys=key1,key2,..."})
        if len(keys) > MAX_QUERY_KEYS:
            raise InvalidParams(f"at most {MAX_QUERY_KEYS} keys a query, got {len(keys)}")
        serving()
        data: dict[str, dict] = {}
        for key, found in zip(keys, service.describe(keys)):
            if found is None:
                data[key] = {"ok": False, "error": NOT_FOUND}
                continue
            item: dict[str, Any] = {"ok": True, "values": _descriptors(found["replicas"])}
            if found["disk_name"] is not None:
                item["disk_values"] = [{"file_path": found["disk_name"],
                                        "object_size": found["nbytes"]}]
            data[key] = item
        return {"data": data}

    def remove_all(environ: dict) -> dict:
        force = _optional(environ, "force") in ("true", "1")
        tenant = _optional(environ, "tenant_id")
        if tenant not in ("", "default"):
            raise InvalidParams(f"no tenant {tenant!r}: this master has one tenant, 'default'")
        serving()
        return {"removed_count": host.remove_all(force)}

    json_routes: dict[tuple[str, str], Callable[[dict], dict]] = {
        ("POST", "/api/v1/drain_jobs"): create,
        ("GET", "/api/v1/drain_jobs/query"): lambda env: service.query_drain_job(_query(env, "job_id")),
        ("POST", "/api/v1/drain_jobs/cancel"): cancel,
        ("GET", "/api/v1/segments/status"): segment,
        ("GET", "/query_key"): query_key,
        ("GET", "/batch_query_keys"): batch_query_keys,
        ("POST", "/api/v1/remove_all"): remove_all,
    }

    # -- routes that answer in their own shape -----------------------------------------
    def all_keys(environ: dict, start: Callable) -> Iterable[bytes]:
        serving()
        return _stream(start, service.all_keys())

    def all_segments(environ: dict, start: Callable) -> Iterable[bytes]:
        serving()
        return _stream(start, [seg["name"] for seg in service.segments_detail()])

    def segments_detail(environ: dict, start: Callable) -> Iterable[bytes]:
        serving()
        segments = [{
            "segment_name": seg["name"], "segment_id": seg["name"],
            "client_id": seg["client_id"], "base_address": hex(seg["base"]),
            "size_bytes": seg["nbytes"], "size_human": f"{seg['nbytes'] / (1 << 30):g} GiB",
            "te_endpoint": seg["name"], "protocol": PROTOCOL, "status": seg["status"],
            "allocator_used_bytes": seg["used"], "allocator_capacity_bytes": seg["nbytes"],
            "allocator_usage_percent": seg["used"] / seg["nbytes"] * 100 if seg["nbytes"] else 0.0,
        } for seg in service.segments_detail()]
        return _reply(start, "200 OK", {"total_segments": len(segments), "segments": segments})

    def query_segment(environ: dict, start: Callable) -> Iterable[bytes]:
        name = _query(environ, "segment")
        serving()
        found = [seg for seg in service.segments_detail() if seg["name"] == name]
        if not found:
            return _send(start, "500 Internal Server Error", _TEXT,
                         f"Failed to query segment: {name} is not mounted".encode())
        return _send(start, "200 OK", _TEXT, f"{name}\nUsed(bytes): {found[0]['used']}\n"
                     f"Capacity(bytes) : {found[0]['nbytes']}\n".encode())

    def role(environ: dict, start: Callable) -> Iterable[bytes]:
        return _send(start, "200 OK", _PLAIN, _role(host.ha_state()).encode())

    def ha_status(environ: dict, start: Callable) -> Iterable[bytes]:
        return _send(start, "200 OK", _PLAIN, host.ha_state().encode())

    def leader(environ: dict, start: Callable) -> Iterable[bytes]:
        found = host.leader()
        payload: dict[str, Any] = {"present": found is not None}
        if found is not None:
            payload.update(leader_address=found[0], view_version=found[1])
        return _reply(start, "200 OK", payload)

    def summary(environ: dict, start: Callable) -> Iterable[bytes]:
        state = host.ha_state()
        stats = " ".join(f"{k}={v}" for k, v in service.stats().items())
        line = (f"role={_role(state)}, state={state}, "
                f"service_ready={'true' if state == 'serving' else 'false'}, master={{{stats}}}")
        found = host.leader()
        if found is not None:
            line += f", leader={found[0]}, view_version={found[1]}"
        return _send(start, "200 OK", _TEXT, line.encode())

    def kv_events(environ: dict, start: Callable) -> Iterable[bytes]:
        serving()
        events = host.events
        return _reply(start, "200 OK", events.stats() if events is not None else {
            "enabled": False, "published_batches": 0, "published_events": 0,
            "dropped_events": 0, "skipped_unparsed_keys": 0})

    def health(environ: dict, start: Callable) -> Iterable[bytes]:
        return _send(start, "200 OK", "text/plain", b"OK")

    raw_routes: dict[tuple[str, str], Callable[[dict, Callable], Iterable[bytes]]] = {
        ("GET", "/get_all_keys"): all_keys,
        ("GET", "/get_all_segments"): all_segments,
        ("GET", "/get_segments_detail"): segments_detail,
        ("GET", "/query_segment"): query_segment,
        ("GET", "/role"): role,
        ("GET", "/ha_status"): ha_status,
        ("GET", "/leader"): leader,
        ("GET", "/metrics/summary"): summary,
        ("GET", "/kv_events/status"): kv_events,
        ("GET", "/health"): health,
    }
    paths = {p for _, p in (*json_routes, *raw_routes)}

    def app(environ: dict, start: Callable) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "")
        handler = json_routes.get((method, path))
        raw = raw_routes.get((method, path))
        if handler is None and raw is None:
            if path in paths:
                return _reply(start, "405 Method Not Allowed",
                              {"success": False, "error_code": -600, "error_message": "wrong method"})
            return metrics_app(environ, start)
        try:
            if raw is not None:
                return raw(environ, start)
            payload: dict[str, Any] = {"success": True, **handler(environ)}
            return _reply(start, "200 OK", payload)
        except _Reply as early:
            return _reply(start, early.status, early.payload)
        except MooncakeError as exc:
            code = exc.code if isinstance(exc, StoreError) else -1
            log.warning("admin %s %s refused: %s", method, path, exc)
            return _reply(start, _HTTP_STATUS.get(code, "500 Internal Server Error"),
                          {"success": False, "error_code": code, "error_message": str(exc)})

    return app


def _role(state: str) -> str:
    """The original's role of a runtime state: ``leader`` once serving, else ``standby``."""
    return "leader" if state == "serving" else "standby"
