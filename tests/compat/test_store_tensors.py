"""Tensor methods of ``mooncake.store.MooncakeDistributedStore`` against a live master: the
original's ``[304-byte header | data]`` layout, return codes, zero-copy ``*_from``/``*_into``
forms, tensor-parallel shards and safetensors files."""

from __future__ import annotations

import ctypes
import struct
from typing import Iterator

import pytest
from helpers import require_module

torch = require_module("torch", "torch is not installed (pip install torch==2.13.0, the CPU wheel "
                                "that .ci/run installs)")

from mooncake_plugins.compat.store import MooncakeDistributedStore, ReplicateConfig  # noqa: E402
from mooncake_plugins.errors import BufferTooSmall  # noqa: E402
from mooncake_plugins.store import tensors as T  # noqa: E402
from mooncake_plugins.store.master import MasterConfig  # noqa: E402
from mooncake_plugins.store.server import MasterServer, ServerOptions  # noqa: E402
from cuda_double import double  # noqa: E402,F401  (the CUDA driver test double fixture)

INVALID_PARAMS = -600
MAX_TP = 1 << 17  # more tp shards than one batch read takes


@pytest.fixture
def store() -> Iterator[MooncakeDistributedStore]:
    server = MasterServer(MasterConfig(default_kv_lease_ttl_ms=50), ServerOptions(rpc_port=0))
    server.start()
    s = MooncakeDistributedStore()
    try:
        assert s.setup("localhost", "P2PHANDSHAKE", 32 << 20, 1 << 20, "tcp", "", server.address) == 0
        yield s
    finally:
        s.close()
        server.close()


class Registered:
    """A registered ctypes buffer (unregistered on exit)."""

    def __init__(self, store: MooncakeDistributedStore, size: int) -> None:
        self.store, self.buf = store, ctypes.create_string_buffer(size)
        self.ptr, self.size = ctypes.addressof(self.buf), size

    def __enter__(self) -> "Registered":
        assert self.store.register_buffer(self.ptr, self.size) == 0
        return self

    def __exit__(self, *exc: object) -> None:
        self.store.unregister_buffer(self.ptr)


def nbytes(t) -> int:
    return t.numel() * t.element_size()


SAMPLES = [
    torch.arange(12, dtype=torch.float32).view(3, 4),
    torch.tensor([True, False, True]),
    torch.randn(2, 3, 4).to(torch.bfloat16),
    torch.arange(-5, 5, dtype=torch.int8),
    torch.arange(6, dtype=torch.float64).view(1, 2, 3),
    torch.arange(4, dtype=torch.int32).to(torch.uint16),
    torch.arange(3, dtype=torch.uint8).view(torch.float8_e4m3fn),
    torch.tensor(7, dtype=torch.int64),                      # 0-dim
    torch.empty((2, 0, 3), dtype=torch.float16),             # no elements
    torch.zeros(1, 1, 1, 1, 1, 1, 1, 2, dtype=torch.int32),  # 8 dims, the most
]


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8)
                                                                     if a.numel() else a,
                                                                     b.view(-1).view(torch.uint8)
                                                                     if b.numel() else b)


# -- the layout ---------------------------------------------------------------------------
def test_header_layout_is_the_originals():
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    raw = bytes(T.encode(t))
    assert len(raw) == 304 + 24 and T.HEADER_SIZE == 304
    magic, version, hsize, dtype, ndim, layout, flags, off, data = struct.unpack_from("<IHHiiIIQQ", raw)
    assert (raw[:4], version, hsize, dtype, ndim, layout, flags, off, data) == \
        (b"NOOM", 1, 304, 0, 2, 0, 0, 304, 24)
    assert struct.unpack_from("<8q", raw, 40) == (2, 3, -1, -1, -1, -1, -1, -1)   # global
    assert struct.unpack_from("<8q", raw, 104) == (2, 3, -1, -1, -1, -1, -1, -1)  # local
    assert raw[168:304] == bytes(136)                      # no parallel axes
    assert raw[304:] == t.numpy().tobytes()
    assert [T.dtype_code(getattr(torch, n)) for n in ("bfloat16", "float8_e4m3fn", "bool")] == [12, 13, 10]


def test_header_is_checked():
    raw = bytearray(T.encode(torch.arange(4, dtype=torch.int32)))
    assert T.parse_header(raw).local_shape == (4,)
    for broken in (raw[:-1], raw[:100], b"X" + raw[1:]):
        with pytest.raises(T.InvalidParams):
            T.parse_header(broken)
    with pytest.raises(T.InvalidParams):
        T.encode(torch.zeros(1, 1, 1, 1, 1, 1, 1, 1, 1))  # 9 dims
    with pytest.raises(T.InvalidParams):
        T.encode(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(T.InvalidParams):
        T.encode(b"not a tensor")


def test_tp_shard_headers():
    from mooncake_plugins.store import tensor_parallel as P
    t = torch.arange(24, dtype=torch.float32).view(4, 6)
    for rank, part, h in P.tp_shards(t, 3, 1):
        assert torch.equal(part, t[:, 2 * rank:2 * rank + 2])
        assert (h.layout, h.global_shape, h.local_shape) == (T.Layout.SHARD, (4, 6), (4, 2))
        assert h.axes == [T.Axis(T.AxisKind.TP, 0, rank, 3, 1, 0, 2)]
        assert T.parse_header(T.encode(part, h)) == h
    with pytest.raises(T.InvalidParams):
        P.tp_shards(t, 4, 1)  # 6 does not split in 4


# -- put / get ----------------------------------------------------------------------------
def test_put_get_every_kind(store):
    for i, t in enumerate(SAMPLES):
        assert store.put_tensor(f"t{i}", t) == 0
        assert store.get_size(f"t{i}") == 304 + nbytes(t)
        assert store.get(f"t{i}") == bytes(T.encode(t))
        back = store.get_tensor(f"t{i}")
        assert same(back, t)
        if back.numel():  # writable memory of its own
            back.reshape(-1).view(torch.uint8)[0] = 1
    assert all(same(b, t) for b, t in zip(store.batch_get_tensor([f"t{i}" for i in range(len(SAMPLES))]),
                                          SAMPLES))
    assert store.get_tensor("missing") is None
    assert store.batch_get_tensor(["t0", "missing"])[1] is None
    store.put("raw", b"x" * 400)
    assert store.get_tensor("raw") is None  # not a tensor object


def test_put_keeps_existing_and_upsert_replaces(store):
    a, b = torch.ones(3), torch.zeros(5, dtype=torch.int64)
    assert store.put_tensor("k", a) == 0
    assert store.put_tensor("k", b) == 0  # as the original: success, object unchanged
    assert same(store.get_tensor("k"), a)
    assert store.upsert_tensor("k", b) == 0 and same(store.get_tensor("k"), b)
    assert store.batch_upsert_tensor(["k", "n"], [a, b]) == [0, 0]
    assert same(store.get_tensor("k"), a) and same(store.get_tensor("n"), b)


def test_batch_and_pub_codes(store):
    ts = [torch.arange(4.0), torch.arange(6).view(2, 3)]
    assert store.batch_put_tensor(["a", "b"], ts) == [0, 0]
    assert store.batch_put_tensor(["c", "d"], [ts[0], "nope"]) == [0, INVALID_PARAMS]
    assert store.is_exist("c") == 1 and store.is_exist("d") == 0
    assert store.batch_put_tensor(["x"], ts) == [INVALID_PARAMS]
    assert store.batch_put_tensor([], []) == []
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    assert store.pub_tensor("p", ts[1], cfg) == 0 and same(store.get_tensor("p"), ts[1])
    assert store.batch_pub_tensor(["p1", "p2"], ts, cfg) == [0, 0]
    assert store.upsert_pub_tensor("p", ts[0], cfg) == 0 and same(store.get_tensor("p"), ts[0])
    assert store.batch_upsert_pub_tensor(["p1"], [ts[1]], cfg) == [0]
    cfg.preferred_segments = ["a", "b"]  # two segments for one replica
    assert store.pub_tensor("bad", ts[0], cfg) == INVALID_PARAMS
    assert store.batch_pub_tensor(["bad"], [ts[0]], cfg) == [INVALID_PARAMS]


# -- zero-copy forms ------------------------------------------------------------------------
def test_get_into_views_the_buffer_and_put_from_writes_it(store):
    t = torch.arange(10, dtype=torch.float32)
    size = 304 + nbytes(t)
    assert store.put_tensor("src", t) == 0
    with Registered(store, size) as buf:
        got = store.get_tensor_into("src", buf.ptr, size)
        assert same(got, t)
        got.fill_(42.0)  # the tensor is the buffer's memory
        assert buf.buf.raw[304:308] == struct.pack("<f", 42.0)
        assert store.put_tensor_from("dst", buf.ptr, size) == 0
        assert torch.equal(store.get_tensor("dst"), torch.full((10,), 42.0))
        got.fill_(1.0)
        assert store.upsert_tensor_from("dst", buf.ptr, size) == 0
        assert torch.equal(store.get_tensor("dst"), torch.ones(10))
        assert store.get_tensor_into("src", buf.ptr, size - 1) is None  # too small
        buf.buf[0] = b"X"  # no longer a tensor object
        assert store.put_tensor_from("bad", buf.ptr, size) == INVALID_PARAMS
        assert store.put_tensor_from("bad", buf.ptr, 100) == INVALID_PARAMS
        assert store.put_tensor_from("bad", 0, size) == INVALID_PARAMS
        assert store.is_exist("bad") == 0


def test_batch_into_and_from(store):
    ts = [torch.arange(8, dtype=torch.int16), torch.empty((0, 4))]
    sizes = [304 + nbytes(t) for t in ts]
    assert store.batch_put_tensor(["a", "b"], ts) == [0, 0]
    with Registered(store, 1024) as buf:
        ptrs = [buf.ptr, buf.ptr + 512]
        got = store.batch_get_tensor_into(["a", "b", "zz"], ptrs + [buf.ptr + 800], sizes + [100])
        assert same(got[0], ts[0]) and same(got[1], ts[1]) and got[2] is None
        assert store.batch_put_tensor_from(["c", "d"], ptrs, sizes) == [0, 0]
        assert store.batch_upsert_tensor_from(["c", "d"], ptrs[::-1], sizes[::-1]) == [0, 0]
        assert same(store.get_tensor("c"), ts[1]) and same(store.get_tensor("d"), ts[0])
        assert store.batch_put_tensor_from(["e", "f"], ptrs, [sizes[0], 10]) == [INVALID_PARAMS] * 2
        assert store.batch_put_tensor_from(["e"], ptrs, sizes) == [INVALID_PARAMS]
        assert store.batch_put_tensor_from([], [], []) == []


class AfterLookup:
    """A destination tensor that runs ``callback`` when the store inspects it, which it
    does after its lookup and before reading the data (as upstream's regression tests
    interpose an upsert or a delay there)."""

    def __init__(self, tensor, callback) -> None:
        self.tensor, self.callback = tensor, callback

    def is_contiguous(self) -> bool:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()
        return self.tensor.is_contiguous()

    def __getattr__(self, name):
        return getattr(self.tensor, name)


def test_get_tensor_into_cuda_reads_the_data_into_a_registered_tensor(store):
    original = torch.arange(8, dtype=torch.float32)
    size = nbytes(original)
    assert store.put_tensor("t", original) == 0
    dest = torch.full_like(original, -1)
    assert store.register_buffer(dest.data_ptr(), size) == 0
    upserts = []
    proxy = AfterLookup(dest, lambda: upserts.append(store.upsert_tensor("t", original + 100)))
    assert store.get_tensor_into_cuda("t", proxy) == size
    assert upserts == [0] and torch.equal(dest, original), "the version the lookup found"
    assert torch.equal(store.get_tensor("t"), original + 100)
    dest.fill_(-1)
    assert store.batch_get_tensor_into_cuda(["t-missing", "t"], [dest, dest]) == [-704, size]
    assert torch.equal(dest, original + 100)
    small = torch.empty(2)
    assert store.get_tensor_into_cuda("t", small) == BufferTooSmall.code
    assert store.get_tensor_into_cuda("t", torch.empty(8).view(2, 4).t()) == BufferTooSmall.code
    assert store.batch_get_tensor_into_cuda(["t"], []) == [INVALID_PARAMS]
    assert store.unregister_buffer(dest.data_ptr()) == 0
    assert store.get_tensor_into_cuda("t", dest) < 0, "unregistered memory is refused"


def test_get_tensor_into_cuda_past_the_lease_is_lease_expired(store):
    t = torch.arange(8, dtype=torch.float32)
    assert store.put_tensor("slow", t) == 0
    dest = torch.empty_like(t)
    assert store.register_buffer(dest.data_ptr(), nbytes(t)) == 0
    proxy = AfterLookup(dest, lambda: __import__("time").sleep(0.1))   # the lease is 50 ms
    assert store.get_tensor_into_cuda("slow", proxy) == -707
    assert store.unregister_buffer(dest.data_ptr()) == 0


def test_tensor_reads_into_gpu_memory(store, double, monkeypatch):
    """Into GPU memory (the CUDA TEST DOUBLE's): the data lands through CUDA copies, and
    ``get_tensor_into`` returns a tensor over the device buffer without a CPU view of it
    (torch's CUDA view is stood in for by a CPU view of the double's memory)."""
    t = torch.arange(16, dtype=torch.int32).view(4, 4)
    assert store.put_tensor("g", t) == 0
    size = 304 + nbytes(t)
    dev = double.alloc(size)
    assert store.register_buffer(dev, size) == 0
    views = []

    def cuda_view(address, n, device):
        views.append((address, n, device))
        return torch.frombuffer((ctypes.c_char * n).from_address(address), dtype=torch.uint8)

    monkeypatch.setattr(T, "cuda_view", cuda_view)
    double.copy_log.clear()
    got = store.get_tensor_into("g", dev, size)
    assert same(got, t) and views == [(dev + 304, nbytes(t), 0)]
    assert double.copy_log, "the object reached the device buffer through CUDA copies"
    dest = torch.frombuffer((ctypes.c_char * nbytes(t)).from_address(dev), dtype=torch.int32)
    double.copy_log.clear()
    assert store.get_tensor_into_cuda("g", dest) == nbytes(t)
    assert torch.equal(dest.view(4, 4), t) and double.copy_log
    assert store.unregister_buffer(dev) == 0


# -- tensor parallel --------------------------------------------------------------------------
def test_tp_shards_round_trip(store):
    t = torch.arange(24, dtype=torch.float32).view(4, 6)
    assert store.put_tensor_with_tp("w", t, tp_size=2, split_dim=1) == 0
    for rank in range(2):
        shard = store.get_tensor_with_tp("w", tp_rank=rank, tp_size=2)
        assert torch.equal(shard, t[:, 3 * rank:3 * rank + 3])
        h = T.parse_header(store.get(f"w_tp_{rank}"))
        assert h.layout == T.Layout.SHARD and h.global_shape == (4, 6) and h.axes[0].rank == rank
    assert store.is_exist("w") == 0
    assert store.put_tensor_with_tp("odd", t, tp_size=4, split_dim=1) == INVALID_PARAMS
    assert store.is_exist("odd_tp_0") == 0
    assert store.put_tensor_with_tp("one", t, tp_size=1) == 0 and torch.equal(store.get_tensor("one"), t)
    assert torch.equal(store.get_tensor_with_tp("one"), t)

    ts = [t, torch.arange(8).view(2, 4)]
    assert store.batch_put_tensor_with_tp(["b0", "b1"], ts, tp_size=2) == [0, 0]
    got = store.batch_get_tensor_with_tp(["b0", "b1"], tp_rank=1, tp_size=2)
    assert torch.equal(got[0], t[2:]) and torch.equal(got[1], ts[1][1:])
    cfg = ReplicateConfig()
    assert store.pub_tensor_with_tp("p", t, cfg, tp_size=2, split_dim=0) == 0
    assert store.batch_pub_tensor_with_tp(["p1", "p2"], [t, "x"], cfg, tp_size=2) == [0, INVALID_PARAMS]
    with Registered(store, 1024) as buf:
        size = 304 + 48
        assert torch.equal(store.get_tensor_with_tp_into("b0", buf.ptr, size, 0, 2), t[:2])
        got = store.batch_get_tensor_with_tp_into(["b0", "p"], [buf.ptr, buf.ptr + 512], [size] * 2, 1, 2)
        assert torch.equal(got[0], t[2:]) and torch.equal(got[1], t[2:])
        buf.buf[:304 + 96] = bytes(T.encode(t))
        assert store.put_tensor_with_tp_from("f", buf.ptr, 304 + 96, tp_size=3, split_dim=1) == 0
        assert torch.equal(store.get_tensor_with_tp("f", 2, 3), t[:, 4:])
        assert store.batch_put_tensor_with_tp_from(["g", "h"], [buf.ptr, buf.ptr + 1], [400, 400],
                                                   tp_size=2) == [0, INVALID_PARAMS]
        assert torch.equal(store.get_tensor_with_tp("g", 1, 2), t[2:])


# -- safetensors ----------------------------------------------------------------------------
def test_safetensors_save_and_load(store, tmp_path):
    pytest.importorskip("safetensors")
    t = torch.arange(6, dtype=torch.int32).view(2, 3)
    path = str(tmp_path / "t.safetensors")
    assert store.put_tensor("k", t) == 0
    assert store.save_tensor_to_safetensor("k", path) == 0
    loaded = store.load_tensor_from_safetensor("other", path)  # not in the file: its first entry
    assert torch.equal(loaded, t) and torch.equal(store.get_tensor("other"), t)
    assert torch.equal(store.load_tensor_from_safetensor(None, path), t)
    assert torch.equal(store.get_tensor(path), t)  # stored under the file name
    assert store.save_tensor_to_safetensor("missing", path) == -1100
    assert store.load_tensor_from_safetensor("x", str(tmp_path / "none.safetensors")) is None


# -- unified parallelism ------------------------------------------------------------------------
def axis(kind, rank, size, split_dim=None, **tags):
    from mooncake.store import ParallelAxis
    a = ParallelAxis()
    a.kind, a.rank, a.size, a.split_dim = kind, rank, size, split_dim
    for k, v in tags.items():
        setattr(a, k, v)
    return a


def par(*axes):
    from mooncake.store import TensorParallelism
    p = TensorParallelism()
    p.axes = list(axes)
    return p


def target(mode, parallelism=None):
    from mooncake.store import ReadTarget
    t = ReadTarget()
    t.mode, t.parallelism = mode, parallelism
    return t


class Partition:
    def __init__(self, rank: int, size: int, split_dim: int) -> None:
        self.rank, self.size, self.split_dim = rank, size, split_dim


def test_parallel_keys_and_manifests():
    from mooncake_plugins.store import tensor_parallel as P
    tp = P.Axis(T.AxisKind.TP, 1, 4, 1)
    assert P.shard_key("k", [tp]) == "k_tp_1"
    assert P.shard_key("k", [P.Axis(T.AxisKind.PP, 0, 2, stage_id=3), tp,
                             P.Axis(T.AxisKind.EP, 1, 2, expert_id=7), P.Axis(T.AxisKind.DP, 0, 2)]) \
        == "k__dp_0of2__tp_1of4_sd1__ep_1of2_eid7__pp_0of2_sid3"
    assert P.writer_key("k", P.Writer(0, 3, 1)) == "k__writer_0of3_sd1"
    raw = P.pack_manifest((4, 6), 0, 1, 2)
    assert len(raw) == 96 and raw[:4] == b"NAMW" and P.parse_manifest(raw) == ((4, 6), 0, 1, 2)
    assert P.parse_manifest(None) is None  # no manifest stored
    for bad in (raw[:95], b"x" + raw[1:]):
        with pytest.raises(T.InvalidParams):
            P.parse_manifest(bad)
    for bad in ([P.Axis(T.AxisKind.DP, 0, 2, 0)], [P.Axis(T.AxisKind.EP, 0, 2)], [tp, tp],
                [P.Axis(T.AxisKind.TP, 2, 2, 0)], [P.Axis(T.AxisKind.TP, 0, 2)], []):
        with pytest.raises(T.InvalidParams):
            P.check_axes(bad)


def test_manifest_fields_are_checked():
    from mooncake_plugins.store import tensor_parallel as P
    from mooncake_plugins.store.rpc import MAX_BATCH
    assert P.parse_manifest(P.pack_manifest((MAX_BATCH, 2), 0, 0, MAX_BATCH))[3] == MAX_BATCH
    assert P.parse_manifest(P.pack_manifest((0, 2), 0, 0, 4))[3] == 4  # empty shards
    for shape, dtype, split_dim, count in [
        ((6,), 0, 0, 3_000_000),             # more shards than elements (sizes the reader's lists)
        ((2 * MAX_BATCH,), 0, 0, 2 * MAX_BATCH),  # more keys than one batch read takes
        ((0,), 0, 0, 2**31 - 1),
        ((6,), 0, 0, 4),                     # not uniform
        ((6,), 0, 0, 0), ((6,), 0, 0, -2),
        ((6,), 99, 0, 2), ((6,), -1, 0, 2),  # no such dtype
        ((6,), 0, 1, 2), ((6, 2), 0, -1, 2),  # split dim out of range
        ((2**62, 2**62), 0, 0, 2),           # more bytes than any buffer holds
        ((-2, 2), 0, 1, 2),
    ]:
        with pytest.raises(T.InvalidParams):
            P.parse_manifest(P.pack_manifest(shape, dtype, split_dim, count))


def _header(dtype=0, gshape=(4,), lshape=(4,), nbytes=16, axes=()):
    """Raw header bytes with any field values (parse_header must check them all)."""
    def shape(dims):
        return struct.pack("<8q", *dims, *([-1] * (8 - len(dims))))
    raw = struct.pack("<IHHiiIIQQ", 0x4D4F4F4E, 1, 304, dtype, len(lshape), 1 if axes else 0, 0, 304,
                      nbytes) + shape(gshape) + shape(lshape) + struct.pack("<II", len(axes), 0)
    raw += b"".join(struct.pack("<6iq", *a) for a in axes)
    return raw + bytes(304 - len(raw)) + bytes(nbytes)


def test_header_fields_are_bounded(store):
    assert T.parse_header(_header()).local_shape == (4,)
    for bad in (_header(lshape=(0, 2**63 - 1, 2), gshape=(0, 2**63 - 1, 2), nbytes=0),  # no room
                _header(gshape=(2**62, 2**62), lshape=(0, 4), nbytes=0),
                _header(dtype=15), _header(dtype=-1),
                _header(axes=[(1, 0, 0, 2, 1, 0, 2)]),            # split dim past ndim
                _header(axes=[(1, 0, 2, 2, 0, 0, 2)]),            # rank not below count
                _header(axes=[(9, 0, 0, 2, 0, 0, 2)])):           # no such axis kind
        with pytest.raises(T.InvalidParams):
            T.parse_header(bad)
        assert store.upsert("hostile", bad) == 0
        assert store.get_tensor("hostile") is None
        assert store.get_tensor_with_parallelism("hostile") is None


def test_hostile_manifests_and_shards_read_as_none(store):
    from mooncake_plugins.store import tensor_parallel as P
    t = torch.arange(24, dtype=torch.float32).view(4, 6)
    full = target("full", par(axis("tp", 0, 2, 1)))
    manifests = {"dtype": P.pack_manifest((4, 6), 99, 1, 2),
                 "shape": P.pack_manifest((5, 6), 0, 1, 2),        # the shards are 4 x 3
                 "itemsize": P.pack_manifest((4, 6), 1, 1, 2),     # float64; the shards are float32
                 "huge": P.pack_manifest((2**40, 6), 0, 1, 2)}
    for name, manifest in manifests.items():
        assert store.put(P.manifest_key(name), manifest) == 0  # stays: a put keeps what is there
        for rank in range(2):
            assert store.put_tensor_with_parallelism(name, t[:, 3 * rank:3 * rank + 3].contiguous(),
                                                     par(axis("tp", rank, 2, 1))) == 0
        assert store.get_tensor_with_parallelism(name, full) is None, name
        assert store.get_tensor_with_parallelism(name, target("shard", par(axis("tp", 1, 3, 1)))) is None
        assert torch.equal(store.get_tensor_with_parallelism(name, target("shard", par(axis("tp", 1, 2, 1)))),
                           t[:, 3:])  # its own shard needs no manifest
    # writer partitions: a huge shard count is refused before any key is read
    for rank in range(2):
        assert store.put_tensor_with_parallelism("w", t, writer_partition=Partition(rank, 2, 1)) == 0
    assert store.upsert(P.writer_manifest_key("w"), P.pack_manifest((4, 6), 0, 1, 3_000_000)) == 0
    assert store.get_tensor_with_parallelism("w", target("full")) is None
    assert store.upsert(P.writer_manifest_key("w"), P.pack_manifest((4, 12), 0, 1, 2)) == 0
    assert store.get_tensor_with_parallelism("w", target("full")) is None  # shards of the wrong shape
    # a shard header claiming a huge tp size is refused the same way
    huge = T.TensorHeader(0, (2**20, 6), (2**20 // MAX_TP, 6), T.Layout.SHARD,
                          [T.Axis(T.AxisKind.TP, 0, 0, MAX_TP, 0, 0, 2**20 // MAX_TP)], 0)
    huge.data_bytes = huge.expected_bytes()
    assert store.put("h_tp_0", T.pack_header(huge) + bytes(huge.data_bytes)) == 0
    assert store.get_tensor_with_parallelism("h", target("full", par(axis("tp", 0, 2, 0)))) is None
    assert P.check_axes([P.Axis(T.AxisKind.TP, 0, MAX_TP // 2, 0)])
    with pytest.raises(T.InvalidParams):
        P.check_axes([P.Axis(T.AxisKind.TP, 0, MAX_TP, 0)])


def test_parallel_writes_and_reads(store):
    t = torch.arange(24, dtype=torch.float32).view(4, 6)
    # no layout: the tensor as it is
    assert store.put_tensor_with_parallelism("plain", t) == 0
    assert torch.equal(store.get_tensor_with_parallelism("plain"), t)
    assert torch.equal(store.get_tensor_with_parallelism("plain", target("as_stored")), t)
    # one tp axis: each writer passes its shard; any tp size can read shards or the whole
    for rank in range(2):
        shard = t[:, 3 * rank:3 * rank + 3].contiguous()
        assert store.put_tensor_with_parallelism("tp", shard, par(axis("tp", rank, 2, 1))) == 0
    assert store.is_exist("tp_tp_1") == 1 and store.is_exist("tp__parallelism_manifest") == 1
    assert torch.equal(store.get_tensor_with_parallelism("tp", target("full", par(axis("tp", 0, 2, 1)))), t)
    assert torch.equal(store.get_tensor_with_parallelism("tp", target("shard", par(axis("tp", 1, 2, 1)))),
                       t[:, 3:])
    assert torch.equal(store.get_tensor_with_parallelism("tp", target("shard", par(axis("tp", 2, 3, 1)))),
                       t[:, 4:])  # another tp size: cut from the rebuilt tensor
    assert store.get_tensor_with_parallelism("tp", target("full", par(axis("tp", 0, 2, 0)))) is None
    # several axes: each writer passes the full tensor and stores its own slice
    dp_tp = [par(axis("dp", 1, 2), axis("tp", r, 2, 0)) for r in range(2)]
    assert store.batch_put_tensor_with_parallelism(["m", "m"], [t, t], dp_tp) == [0, 0]
    assert store.is_exist("m__dp_1of2__tp_1of2_sd0") == 1
    assert torch.equal(store.get_tensor_with_parallelism("m", target("shard", dp_tp[1])), t[2:])
    got = store.batch_get_tensor_with_parallelism(["m", "tp"], [target("full", dp_tp[0]),
                                                                target("full", par(axis("tp", 0, 2, 1)))])
    assert torch.equal(got[0], t) and torch.equal(got[1], t)
    other_dp = par(axis("dp", 0, 2), axis("tp", 0, 2, 0))
    assert store.get_tensor_with_parallelism("m", target("shard", other_dp)) is None
    assert store.upsert_tensor_with_parallelism("m", t + 1, dp_tp[0]) == 0
    assert torch.equal(store.get_tensor_with_parallelism("m", target("shard", dp_tp[0])), t[:2] + 1)
    # axes without tp: stored as given; refused layouts change nothing
    ep = par(axis("ep", 0, 2, expert_id=5))
    assert store.put_tensor_with_parallelism("e", t, ep) == 0
    assert torch.equal(store.get_tensor_with_parallelism("e", target("shard", ep)), t)
    assert store.put_tensor_with_parallelism("bad", t, par(axis("dp", 0, 2, 0))) == INVALID_PARAMS
    assert store.put_tensor_with_parallelism("bad", t, par(axis("dp", 0, 2), axis("tp", 0, 4, 1))) \
        == INVALID_PARAMS
    assert store.put_tensor_with_parallelism("bad", t, par(axis("tp", 0, 2, 1)), None,
                                             Partition(0, 2, 0)) == INVALID_PARAMS
    assert store.batch_put_tensor_with_parallelism(["a", "b"], [t, t], [dp_tp[0]]) == [INVALID_PARAMS] * 2
    assert store.get_tensor_with_parallelism("m", target("sideways", dp_tp[0])) is None
    # writer partitions: the full read stitches them through the writer manifest
    for rank in range(3):
        assert store.put_tensor_with_parallelism("w", t, writer_partition=Partition(rank, 3, 1)) == 0
    assert torch.equal(store.get_tensor_with_parallelism("w", target("full")), t)
    assert torch.equal(store.get_tensor_with_parallelism("w", target("shard", par(axis("tp", 2, 3, 1)))),
                       t[:, 4:])


def test_parallel_from_and_into(store):
    t = torch.arange(24, dtype=torch.int64).view(4, 6)
    size = 304 + nbytes(t)
    assert store.put_tensor("seed", t) == 0
    with Registered(store, 4096) as buf:
        assert store.get_tensor_into("seed", buf.ptr, size) is not None
        # a tp axis here: the buffer holds the full tensor and every shard is stored
        assert store.put_tensor_with_parallelism_from("f", buf.ptr, size, par(axis("tp", 0, 2, 0))) == 0
        assert store.is_exist("f_tp_0") == 1 and store.is_exist("f_tp_1") == 1
        assert store.put_tensor_with_parallelism_from("plain", buf.ptr, size) == 0
        assert store.upsert_tensor_with_parallelism_from("plain", buf.ptr, size) == 0
        assert store.batch_put_tensor_with_parallelism_from(
            ["w", "w"], [buf.ptr] * 2, [size] * 2, writer_partitions=[Partition(r, 2, 1) for r in range(2)]) \
            == [0, 0]
        assert store.batch_upsert_tensor_with_parallelism_from(["u"], [buf.ptr], [size]) == [0]
        assert store.put_tensor_with_parallelism_from("bad", buf.ptr, size - 8) == INVALID_PARAMS
        out = buf.ptr + 1024
        shard = store.get_tensor_with_parallelism_into("f", out, 1024, target("shard", par(axis("tp", 1, 2, 0))))
        assert torch.equal(shard, t[2:])
        shard.fill_(-1)  # the returned tensor views the buffer
        assert ctypes.string_at(out + 304, 8) == struct.pack("<q", -1)
        got = store.batch_get_tensor_with_parallelism_into(
            ["w", "plain", "f"], [out, out + 1024, out + 2048], [1024] * 3,
            [target("full"), target("as_stored"), target("full", par(axis("tp", 0, 2, 0)))])
        assert all(torch.equal(g, t) for g in got)
        assert got[0].data_ptr() == out + 304  # rebuilt right in the caller's buffer
        quarter = store.get_tensor_with_parallelism_into("f", out, 1024,
                                                         target("shard", par(axis("tp", 3, 4, 0))))
        assert torch.equal(quarter, t[3:]) and quarter.data_ptr() == out + 304
        assert store.get_tensor_with_parallelism_into("w", out, 100, target("full")) is None  # too small
    assert torch.equal(store.get_tensor("plain"), t) and torch.equal(store.get_tensor("u"), t)


def test_put_tensor_from_a_device_buffer_and_a_bad_pointer(store, double):
    """The ``[header | data]`` header is read through a CUDA copy from GPU memory (over the
    CUDA driver TEST DOUBLE, tests/cuda_double.py), never by the CPU; a pointer to no
    memory at all is INVALID_PARAMS, not a crash."""
    t = torch.arange(10, dtype=torch.float32)
    assert store.put_tensor("src", t) == 0
    size = 304 + nbytes(t)
    dev = double.alloc(size)
    with Registered(store, size) as buf:  # the object's bytes, put into "device" memory
        assert store.get_into("src", buf.ptr, size) == size
        ctypes.memmove(dev, buf.ptr, size)
    assert store.register_buffer(dev, size) == 0
    double.copy_log.clear()
    assert store.put_tensor_from("gdst", dev, size) == 0
    assert any(s == dev and n == 304 for _, s, n in double.copy_log), \
        "the header was read with a CUDA copy"
    assert store.unregister_buffer(dev) == 0
    assert same(store.get_tensor("gdst"), t)
    assert store.put_tensor_from("bad", 8, size) == INVALID_PARAMS  # unmapped: refused
    assert store.is_exist("bad") == 0
