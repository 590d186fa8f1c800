"""Trace loader: valid files load as records, every malformed field names its file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_plugins.conductor.traces import TraceRequest, iter_trace, load_trace
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
