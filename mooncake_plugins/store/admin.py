"""The master's admin HTTP API, served with ``/metrics`` on ``--metrics_port`` as the original.

Routes (JSON bodies and replies, ``success`` plus the original's field names):

- ``GET /health``: ``OK`` while the master serves.
- ``POST /api/v1/drain_jobs`` ``{"segments": [...], "target_segments": [...],
  "max_concurrency": n}``: start draining segments (:meth:`MasterService.create_drain_job`).
- ``GET /api/v1/drain_jobs/query?job_id=...``: a job's progress.
- ``POST /api/v1/drain_jobs/cancel?job_id=...``: stop a job.
- ``GET /api/v1/segments/status?segment=...``: OK, DRAINING or DRAINED.

Every other path answers the Prometheus metrics (``metrics.py``). A failure replies
``{"success": false, "error_code": <the original's code>, "error_message": ...}``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs

from ..errors import InvalidParams, MooncakeError, StoreError
from .master import MasterService

log = logging.getLogger(__name__)

MAX_BODY_NBYTES = 1 << 20

_HTTP_STATUS = {-600: "400 Bad Request", -1010: "409 Conflict", -1402: "404 Not Found",
                -101: "404 Not Found"}

WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


def _reply(start: Callable, status: str, payload: dict) -> list[bytes]:
    body = json.dumps(payload).encode()
    start(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


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
    value = parse_qs(environ.get("QUERY_STRING", "")).get(name, [""])[0]
    if not value:
        raise InvalidParams(f"missing query parameter {name!r}")
    return value


def admin_app(service: MasterService, metrics_app: WsgiApp) -> WsgiApp:
    """A WSGI app: the admin routes of ``service``, everything else to ``metrics_app``."""

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

    routes: dict[tuple[str, str], Callable[[dict], dict]] = {
        ("POST", "/api/v1/drain_jobs"): create,
        ("GET", "/api/v1/drain_jobs/query"): lambda env: service.query_drain_job(_query(env, "job_id")),
        ("POST", "/api/v1/drain_jobs/cancel"): cancel,
        ("GET", "/api/v1/segments/status"): segment,
    }

    def app(environ: dict, start: Callable) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "")
        if path == "/health" and method == "GET":
            start("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
            return [b"OK"]
        handler = routes.get((method, path))
        if handler is None:
            if any(p == path for _, p in routes):
                return _reply(start, "405 Method Not Allowed",
                              {"success": False, "error_code": -600, "error_message": "wrong method"})
            return metrics_app(environ, start)
        try:
            payload: dict[str, Any] = {"success": True, **handler(environ)}
            return _reply(start, "200 OK", payload)
        except MooncakeError as exc:
            code = exc.code if isinstance(exc, StoreError) else -1
            log.warning("admin %s %s refused: %s", method, path, exc)
            return _reply(start, _HTTP_STATUS.get(code, "500 Internal Server Error"),
                          {"success": False, "error_code": code, "error_message": str(exc)})

    return app
