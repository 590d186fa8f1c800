"""How the rdma transport spreads a batch over its paths (no device needed): in
proportion to what each path delivered, an unmeasured path counted as fast as the best,
and over the queue pairs of a path evenly."""

from __future__ import annotations

from collections import Counter

from mooncake_plugins.transfer.transports.rdma import RdmaTransport, _Connection, _Path, _Qp

MiB = 1 << 20


def connection(rates: list[float], qps_per_path: int = 2) -> _Connection:
    qps = []
    for i, rate in enumerate(rates):
        path = _Path(f"p{i}", (i, i))
        path.rate = rate
        qps += [_Qp(nic=None, qp=None, remote_nic=i, path=path) for _ in range(qps_per_path)]
    return _Connection("peer@1", qps)


def place(conn: _Connection, count: int) -> tuple[Counter, Counter]:
    transport = RdmaTransport.__new__(RdmaTransport)  # _place needs no device
    chosen = [transport._place(conn, MiB) for _ in range(count)]
    return Counter(q.path.name for q in chosen), Counter(id(q) for q in chosen)


def test_slices_follow_the_paths_rates():
    by_path, by_qp = place(connection([3e9, 1e9]), 40)
    assert by_path == {"p0": 30, "p1": 10}
    assert sorted(by_qp.values()) == [5, 5, 15, 15]  # each path's queue pairs share evenly


def test_an_unmeasured_path_gets_the_best_rate():
    by_path, _ = place(connection([2e9, 0.0]), 40)
    assert by_path == {"p0": 20, "p1": 20}


def test_bytes_in_flight_count():
    conn = connection([1e9, 1e9])
    conn.qps[0].path.inflight = 8 * MiB   # another batch is still on p0
    by_path, _ = place(conn, 8)
    assert by_path == {"p1": 8}
