"""Trace loader: valid files load as records, every malformed field names its file:line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from mooncake_plugins.conductor.traces import (BUNDLED_TRACES, TraceRequest, bundled_trace,
                                               iter_trace, load_trace)
from mooncake_plugins.errors import InvalidArgument

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _line(**changes: object) -> str:
    obj = dict(GOOD)
    for key, value in changes.items():
        if value is None:
            del obj[key]
        else:
            obj[key] = value
    return json.dumps(obj)


def test_loads_records_in_order(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(), "", _line(timestamp=12.5, input_length=513,
                                                hash_ids=[0, 7])])
    assert load_trace(path) == [TraceRequest(0, 1000, 5, (0, 1)),
                                TraceRequest(12.5, 513, 5, (0, 7))]


def test_iter_trace_is_lazy(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(), "{not json"])
    records = iter_trace(path)
    assert next(records).input_length == 1000
    with pytest.raises(InvalidArgument):
        next(records)


@pytest.mark.parametrize(("line", "fragment"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (_line(hash_ids=None), "missing field(s) hash_ids"),
    (_line(timestamp=None, output_length=None), "missing field(s) timestamp, output_length"),
    (_line(input_length=-4), "input_length must be an int >= 1"),
    (_line(input_length=0, hash_ids=[]), "input_length must be an int >= 1"),
    (_line(output_length=-1), "output_length must be an int >= 0"),
    (_line(output_length=2.5), "output_length must be an int >= 0"),
    (_line(input_length=True), "input_length must be an int >= 1"),
    (_line(timestamp=-1), "timestamp must be a finite number"),
    (_line(timestamp="0"), "timestamp must be a finite number"),
    (_line(hash_ids="0,1"), "hash_ids must be a list of ints"),
    (_line(hash_ids=[0, -1]), "hash_ids[1] must be an int >= 0"),
    (_line(hash_ids=[0, 1, 2]), "needs 2 hash_ids of 512 tokens, got 3"),
])
def test_bad_line_names_file_and_line(tmp_path: Path, line: str, fragment: str) -> None:
    path = _write(tmp_path, [_line(), line])
    with pytest.raises(InvalidArgument) as info:
        load_trace(path)
    assert f"{path}:2: " in str(info.value)
    assert fragment in str(info.value)


def test_timestamps_must_not_go_back(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(timestamp=10), _line(timestamp=9)])
    with pytest.raises(InvalidArgument, match=r":2: timestamp 9 is earlier"):
        load_trace(path)


def test_empty_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="holds no request"):
        load_trace(_write(tmp_path, [""]))


def test_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.jsonl")


def test_gzipped_trace_loads_whatever_its_name(tmp_path: Path) -> None:
    plain = _write(tmp_path, [_line(), _line(timestamp=3, hash_ids=[0, 9])])
    for name in ("trace.jsonl.gz", "trace.jsonl"):  # recognised by its magic bytes
        packed = tmp_path / "gz" / name
        packed.parent.mkdir(exist_ok=True)
        packed.write_bytes(gzip.compress(plain.read_bytes()))
        assert load_trace(packed) == load_trace(plain)


def test_bad_line_of_a_gzipped_trace_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl.gz"
    path.write_bytes(gzip.compress(f"{_line()}\n{_line(output_length=-1)}\n".encode()))
    with pytest.raises(InvalidArgument, match=rf"{path}:2: output_length must be"):
        load_trace(path)


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_damaged_gzip_is_an_invalid_argument(tmp_path: Path, damage: str) -> None:
    data = gzip.compress(("\n".join([_line()] * 200) + "\n").encode())
    data = data[:len(data) // 2] if damage == "truncated" else data[:20] + b"\xff" * 40 + data[60:]
    path = tmp_path / "trace.jsonl.gz"
    path.write_bytes(data)
    with pytest.raises(InvalidArgument, match=rf"{path}: corrupt gzip data"):
        load_trace(path)


def test_bundled_traces() -> None:
    for name in BUNDLED_TRACES:
        path = bundled_trace(name)
        assert path.name == f"{name}.jsonl.gz" and path.is_file()
    assert (bundled_trace(BUNDLED_TRACES[0]).parent / "README.md").is_file()  # licence note
    with pytest.raises(InvalidArgument, match="no bundled trace 'absent'"):
        bundled_trace("absent")
