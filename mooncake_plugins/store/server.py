"""The master process: MasterService behind RPC, heartbeat reaper, metrics, HA, metadata server.

``MasterServer.start()`` blocks only while campaigning for leadership (HA mode); then the
RPC port serves until ``close()``. A leader that loses its etcd lease stops answering
(every call fails with NotSupported "not the leader") so clients move to the new one.

Durability (journal.py): with HA the leader writes every committed change to etcd (unless
``replicate_metadata`` is off) and a new leader starts from it; a single master does the
same in ``metadata_dir`` when given. Calls that change committed state are answered only
once their changes are written; calls that hand out space wait for the writes of the
frees before them. No journal I/O happens under the service's lock.

Files: the only ones the master deletes are SSD-tier replicas it named itself under
``root_fs_dir`` (:func:`offload.delete_under`), after the call that dropped them released
the service's lock and before its reply is sent.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..errors import InvalidParams, MooncakeError, NotSupported
from . import offload
from .journal import EtcdJournal, FileJournal, Journal
from .kv_events import KvEventConfig, KvEventPublisher
from .master import MasterConfig, MasterService, PutConfig
from .rpc import ListOf, RpcServer

log = logging.getLogger(__name__)

_GATE_WAIT_S = 5.0
"""How long a call that reached a candidate waits for it to become the leader."""

PUT_CONFIG = {"replica_num": int, "preferred_segments": ListOf(str), "with_soft_pin": bool,
              "upsert": bool, "soft_pin_action": str, "soft_pin_ttl_ms": (int, type(None)),
              "with_hard_pin": bool}


def _each(keys: list[str], fn: Callable[[str], Any]) -> list[list]:
    """Run ``fn`` per key; a failure becomes ``[code, message]`` for that key only."""
    out = []
    for k in keys:
        try:
            out.append([0, fn(k)])
        except MooncakeError as exc:
            out.append([exc.code, str(exc)])
    return out


@dataclass
class ServerOptions:
    """Process-level options of ``mooncake-master`` (the rest is MasterConfig)."""

    host: str = "127.0.0.1"
    rpc_port: int = 50051
    metrics_port: int | None = None       # metrics + admin HTTP (admin.py); None: none, 0: a free port
    metrics_host: str | None = None       # None: same as host
    metric_report_interval_s: float = 0.0  # log a stats line this often, if changed; 0: never
    http_metadata_port: int | None = None  # None: no embedded metadata server
    http_metadata_host: str | None = None  # None: same as host
    enable_ha: bool = False
    etcd_endpoints: str = ""
    cluster_id: str = "mooncake"
    reap_interval_s: float = 0.5
    replicate_metadata: bool = True        # with HA: committed metadata goes to etcd
    metadata_dir: str = ""                 # without HA: the journal's directory ("": none)
    metadata_fsync: bool = False           # fsync each batch of the local journal
    kv_events: KvEventConfig | None = None  # publish KV events (kv_events.py); None: off;
    # an empty backend_id is this master's address


class MasterServer:
    """One master process (leader or, in HA mode, a candidate)."""

    def __init__(self, config: MasterConfig, options: ServerOptions) -> None:
        self.config = config
        self.options = options
        self.service = MasterService(config)
        self._rpc: RpcServer | None = None
        self._metadata = None
        self._metrics = None
        self._election = None
        self.events: KvEventPublisher | None = None
        self._state = "starting"               # the original's runtime state (ha_state)
        self.journal: Journal | None = None
        self.recovery_s = 0.0                  # how long loading the journal took
        self._stop = threading.Event()
        self.lost_leadership = threading.Event()
        self._leading = threading.Event()   # set once serving (after winning, with HA)
        self._reaper = threading.Thread(target=self._reap_loop, name="mc-master-reaper", daemon=True)

    def _delete_dropped(self) -> None:
        """Delete the SSD-tier files the service let go of (outside its lock)."""
        for name in self.service.take_disk_drops():
            try:
                offload.delete_under(self.config.root_fs_dir, name)
            except ValueError as exc:
                log.error("not deleting disk replica %s: %s", name, exc)
            except OSError as exc:
                log.warning("could not delete disk replica %s under %s: %s", name,
                            self.config.root_fs_dir, exc)

    def _deleting(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, then the deletion of the disk replicas it dropped."""
        def call(**args: Any) -> Any:
            try:
                return fn(**args)
            finally:
                self._delete_dropped()
        return call

    @property
    def port(self) -> int:
        assert self._rpc is not None, "start() first"
        return self._rpc.port

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def start(self, stop: threading.Event | None = None) -> bool:
        """Listen, win the election (HA mode), then answer calls. False if stopped first.

        In HA mode the RPC port listens while campaigning; calls wait (up to 5 s) until this
        master leads, so clients that read its address in etcd the moment it won are served.
        """
        opts = self.options
        if opts.http_metadata_port is not None:
            from ..transfer.metadata import MetadataServer

            self._metadata = MetadataServer(opts.http_metadata_host or opts.host,
                                            opts.http_metadata_port).start()
            log.info("embedded metadata server at %s", self._metadata.url)
        if opts.metrics_port is not None:
            from .admin import admin_app
            from .metrics import serve_metrics

            self._metrics = serve_metrics(self.service, opts.metrics_host or opts.host,
                                          opts.metrics_port,
                                          wrap=lambda app: admin_app(self, app))
            log.info("metrics and admin HTTP on %s:%d", opts.metrics_host or opts.host,
                     self._metrics.port)
        if opts.enable_ha and opts.rpc_port == 0:
            raise NotSupported("HA mode needs a fixed --rpc_port to advertise")
        # Listening before the election is won: clients that read the new leader's address
        # in etcd connect at once, and their calls wait in _gate until we lead.
        self._rpc = RpcServer(opts.host, opts.rpc_port, self._handlers(), gate=self._gate)
        if opts.kv_events is not None:   # before the election: a bad endpoint fails the start
            self.events = KvEventPublisher(replace(opts.kv_events, backend_id=(
                opts.kv_events.backend_id or self.address)))
        if opts.enable_ha:
            from .ha import LeaderElection

            self._election = LeaderElection(opts.etcd_endpoints, opts.cluster_id,
                                            f"{opts.host}:{opts.rpc_port}")
            self._election.on_lost(self._on_lost)
            log.info("campaigning for leadership of cluster %s", opts.cluster_id)
            self._state = "candidate"
            if not self._election.campaign(stop=stop):
                return False
            log.info("elected leader of cluster %s", opts.cluster_id)
        self._state = "recovering"
        self._recover()
        if self.events is not None:
            self.service.attach_events(self.events)
        self._state = "serving"
        self._leading.set()
        self._reaper.start()
        log.info("master serving on %s:%d", opts.host, self._rpc.port)
        return True

    def _recover(self) -> None:
        """Open the journal (if any), rebuild the index from it, start writing to it."""
        opts = self.options
        if opts.enable_ha and opts.replicate_metadata:
            backend = EtcdJournal(opts.etcd_endpoints, opts.cluster_id, self._election.lease_id)
        elif opts.metadata_dir and not opts.enable_ha:
            backend = FileJournal(opts.metadata_dir, fsync=opts.metadata_fsync)
        else:
            return
        t0 = time.monotonic()
        try:
            state = backend.load()
        except BaseException:
            backend.close()
            raise
        self.journal = Journal(backend)
        self.service.attach_journal(self.journal)
        n = self.service.restore(state)
        self.journal.start()
        self.recovery_s = time.monotonic() - t0
        log.info("recovered %d objects on %d segments from the metadata journal in %.3f s",
                 n, self.service.stats()["segments"], self.recovery_s)

    def _durable(self, fn: Callable[..., Any], space: bool = False) -> Callable[..., Any]:
        """``fn``, answered once its changes are durable (``space``: once the frees
        before the space it handed out are)."""
        def call(**args: Any) -> Any:
            out = fn(**args)
            if self.journal is not None:
                self.journal.wait(self.service.free_seq if space else self.journal.seq)
            return out
        return call

    def _on_lost(self) -> None:
        log.error("lost leadership of cluster %s: refusing every call from now on",
                  self.options.cluster_id)
        self._state = "standby"
        self.lost_leadership.set()

    # -- what the admin API reads (admin.AdminHost) ------------------------------------
    def ha_state(self) -> str:
        """``starting``, ``candidate`` (campaigning), ``recovering`` (loading the
        journal), ``serving`` or ``standby`` (leadership lost)."""
        return self._state

    def leader(self) -> tuple[str, int] | None:
        """The published leader and its term (with --enable_ha; None without, or when
        none is published or etcd does not answer)."""
        if not self.options.enable_ha:
            return None
        from .ha import find_leader

        try:
            found = find_leader(self.options.etcd_endpoints, self.options.cluster_id)
        except MooncakeError as exc:
            log.warning("admin /leader: etcd did not answer: %s", exc)
            return None
        return None if found is None else (found.address, found.term)

    def _kv_events_info(self) -> dict:
        """Where this master publishes its KV events ("": it does not) and its admin
        HTTP port (0: none), for subscribers that list its keys first (the router)."""
        return {"endpoint": self.events.endpoint if self.events is not None else "",
                "metrics_port": self.metrics_port or 0}

    def remove_all(self, force: bool) -> int:
        """``remove_all`` of the RPC and the admin API: answered once durable, its disk
        files deleted."""
        return self._durable(self._deleting(self.service.remove_all))(force=force)

    def _gate(self) -> None:
        if not self._leading.wait(_GATE_WAIT_S):
            raise NotSupported("this master is a candidate, not the leader")
        if self.lost_leadership.is_set():
            raise NotSupported("this master is not the leader any more")

    @property
    def metrics_port(self) -> int | None:
        """Where the metrics/admin HTTP listens (None: it does not)."""
        return self._metrics.port if self._metrics is not None else None

    def _reap_loop(self) -> None:
        every = self.options.metric_report_interval_s
        next_report = time.monotonic() + every
        reported: dict | None = None   # an idle master logs its stats once, not every interval
        while not self._stop.wait(self.options.reap_interval_s):
            try:
                # a client whose connection is open is alive even if its heartbeats lag
                # (a Python client whose GIL the application holds for seconds); a dead
                # process's connections close, and its TTL runs from the last of them
                self.service.touch_clients(self._rpc.connected_clients())
                self.service.reap()
            except Exception:  # keep reaping whatever one pass hit
                log.exception("reaper pass failed")
            if every and time.monotonic() >= next_report:
                next_report += every
                stats = self.service.stats()
                if stats != reported:
                    reported = stats
                    log.info("master stats: %s", " ".join(f"{k}={v}" for k, v in stats.items()))

    def _handlers(self) -> dict:
        s = self.service
        cfg = self.config

        def register_client(client_id: str, host_id: str) -> dict:
            s.register_client(client_id, host_id)
            return {"lease_ttl_ms": cfg.default_kv_lease_ttl_ms, "client_ttl_s": cfg.client_ttl_s,
                    "enable_offload": cfg.enable_offload,
                    "root_fs_dir": cfg.root_fs_dir if cfg.enable_offload else "",
                    "persist_puts": cfg.persist_puts}

        def put_start(client_id: str, keys: list, sizes: list, config: dict) -> list:
            if len(keys) != len(sizes):
                raise InvalidParams("keys and sizes differ in length")
            s.heartbeat(client_id)  # an unknown client fails the whole call: it re-registers
            pc = PutConfig(**config)
            it = iter(sizes)
            return _each(keys, lambda k: s.put_start(client_id, k, next(it), pc))

        def slots(granted: list) -> dict:
            return {"slots": [[rid, replicas] for rid, replicas in granted],
                    "use_within_s": cfg.put_start_discard_timeout_s / 3}

        def reserve(client_id: str, nbytes: int, replica_num: int, count: int) -> dict:
            return slots(s.reserve(client_id, nbytes, replica_num, count))

        def put_reserved(client_id: str, keys: list, slots_: list, config: dict, refill: list) -> list:
            if len(keys) != len(slots_):
                raise InvalidParams("keys and slots differ in length")
            if refill and len(refill) != 3:
                raise InvalidParams("refill is [] or [nbytes, replica_num, count]")
            pc = PutConfig(**config)
            # refilled first: the eviction that may make room never takes these puts' objects
            granted = slots(s.reserve(client_id, *refill) if refill else [])
            it = iter(slots_)
            return [_each(keys, lambda k: s.put_reserved(client_id, k, next(it), pc)), granted]

        def heartbeat(client_id: str) -> list[dict]:
            s.heartbeat(client_id)
            return s.tasks.take(client_id)  # copy/move tasks this client is to run

        def complete_task(client_id: str, task_id: list, ok: bool, message: str) -> None:
            s.complete_task(client_id, tuple(task_id), ok, message)

        def replica_start(client_id: str, key: str, source: str, targets: list, move: bool) -> list:
            nbytes, src, new = s.replica_start(client_id, key, source, targets, move)
            return [nbytes, src, new]

        cid, keys = {"client_id": str}, {"keys": ListOf(str)}
        task_id = {"task_id": ListOf(int)}
        return {
            "register_client": ({"client_id": str, "host_id": str}, register_client),
            "heartbeat": (cid, heartbeat),
            "unregister_client": (cid, self._durable(s.unregister_client)),
            "create_copy_task": ({"key": str, "targets": ListOf(str)},
                                 lambda key, targets: list(s.create_copy_task(key, targets))),
            "create_move_task": ({"key": str, "source": str, "target": str},
                                 lambda key, source, target:
                                 list(s.create_move_task(key, source, target))),
            "query_task": (task_id, lambda task_id: s.tasks.get(tuple(task_id))),
            "complete_task": ({**cid, **task_id, "ok": bool, "message": str}, complete_task),
            "replica_start": ({**cid, "key": str, "source": str, "targets": ListOf(str),
                               "move": bool}, self._durable(replica_start, space=True)),
            "replica_end": ({**cid, "key": str, "ok": bool}, self._durable(s.replica_end)),
            "batch_replica_clear": ({**cid, **keys, "segment": str}, self._durable(self._deleting(
                lambda client_id, keys, segment: s.batch_replica_clear(client_id, keys, segment)))),
            "mount_segment": ({**cid, "segment": str, "base": int, "nbytes": int}, self._durable(
                lambda client_id, segment, base, nbytes:
                s.mount_segment(client_id, segment, base, nbytes))),
            "unmount_segment": ({**cid, "segment": str}, self._durable(
                lambda client_id, segment: s.unmount_segment(client_id, segment))),
            "put_start": ({**cid, **keys, "sizes": ListOf(int), "config": PUT_CONFIG},
                          self._durable(put_start, space=True)),
            "put_end": ({**cid, **keys}, self._durable(self._deleting(
                lambda client_id, keys: _each(keys, lambda k: s.put_end(client_id, k))))),
            "reserve": ({**cid, "nbytes": int, "replica_num": int, "count": int},
                        self._durable(reserve, space=True)),
            "put_reserved": ({**cid, **keys, "slots": ListOf(int), "config": PUT_CONFIG,
                              "refill": ListOf(int)},
                             self._durable(self._deleting(
                                 lambda client_id, keys, slots, config, refill:
                                 put_reserved(client_id, keys, slots, config, refill)))),
            "put_revoke": ({**cid, **keys},
                           lambda client_id, keys: _each(keys, lambda k: s.put_revoke(client_id, k))),
            "get_replicas": (keys, s.get_many),
            "exist": (keys, lambda keys: [int(x) for x in s.exist_many(keys)]),
            "peek": (keys, lambda keys: [int(x) for x in s.exist_many(keys, lease=False)]),
            "keys_with_suffix": ({"suffix": str, "limit": int}, s.keys_with_suffix),
            "keys_containing": ({"part": str, "limit": int}, s.keys_containing),
            "remove": ({**keys, "force": bool}, self._durable(self._deleting(
                lambda keys, force: _each(keys, lambda k: s.remove(k, force))))),
            "remove_by_regex": ({"pattern": str, "force": bool},
                                self._durable(self._deleting(s.remove_by_regex))),
            "remove_all": ({"force": bool}, self.remove_all),
            "add_disk_replica": (keys, self._durable(lambda keys: _each(keys, s.add_disk_replica))),
            "stats": ({}, s.stats),
            "kv_events": ({}, self._kv_events_info),
        }

    def close(self) -> None:
        """Stop serving, resign leadership and stop every helper server."""
        self._stop.set()
        if self._rpc is not None:
            self._rpc.close()
        if self._reaper.is_alive():
            self._reaper.join()
        if self.journal is not None:
            self.journal.close()   # while still leader: the last changes are written
        if self._election is not None:
            self._election.close()
        if self._metadata is not None:
            self._metadata.stop()
        if self._metrics is not None:
            self._metrics.shutdown()
        if self.events is not None:
            self.events.close()
