"""Loader for Mooncake request traces (JSON Lines, one request per line).

Each line is one object with exactly the fields the open Mooncake traces carry:

``timestamp``
    arrival time in milliseconds since the start of the trace (int or float, >= 0,
    non-decreasing from line to line);
``input_length`` / ``output_length``
    prompt and generated token counts (int, input >= 1, output >= 0);
``hash_ids``
    ids of the prompt's 512-token blocks, in order (ints >= 0). Two requests that share
    the first ``k`` ids share a ``k``-block prefix, so the list must hold exactly
    ``ceil(input_length / 512)`` ids (the last block may be partial).

Every field is checked; a bad line raises :class:`~mooncake_plugins.errors.InvalidArgument`
naming the file and the 1-based line number. Blank lines are skipped. A gzip-compressed file
(recognised by its magic bytes, whatever its name) is decompressed as it is read.

The two open Mooncake traces ship with the package, gzipped (``data/``, Apache License 2.0:
see ``data/README.md``); :func:`bundled_trace` gives their paths.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..errors import InvalidArgument

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 512
"""Tokens per KV block, as in the open Mooncake traces."""

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")

BUNDLED_TRACES = ("conversation_trace", "synthetic_trace")
"""Names of the open Mooncake traces shipped with the package (see :func:`bundled_trace`)."""

_DATA_DIR = Path(__file__).resolve().parent / "data"
_GZIP_MAGIC = b"\x1f\x8b"


def bundled_trace(name: str) -> Path:
    """Path of an open Mooncake trace shipped with the package (a gzipped JSONL file).

    Args:
        name: one of :data:`BUNDLED_TRACES`.

    Returns:
        The path of ``data/NAME.jsonl.gz`` inside the installed package.

    Raises:
        InvalidArgument: ``name`` is not a bundled trace.
    """
    if name not in BUNDLED_TRACES:
        raise InvalidArgument(f"no bundled trace {name!r}; the bundled traces are "
                              f"{', '.join(BUNDLED_TRACES)}")
    return _DATA_DIR / f"{name}.jsonl.gz"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time in milliseconds since the start of the trace.
        input_length: prompt length in tokens.
        output_length: number of generated tokens (the first comes out of prefill).
        hash_ids: ids of the prompt's blocks, ``ceil(input_length / 512)`` of them.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(obj: object, where: str, block_tokens: int = BLOCK_TOKENS) -> TraceRequest:
    """Validate one decoded trace object and turn it into a :class:`TraceRequest`.

    Args:
        obj: the value ``json.loads`` returned for one line.
        where: ``"file:line"``, used as the prefix of every error message.
        block_tokens: tokens per block, to check the number of ``hash_ids``.

    Returns:
        The validated record.

    Raises:
        InvalidArgument: a field is missing, has the wrong type or an impossible value.
    """
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [name for name in _FIELDS if name not in obj]
    if missing:
        raise InvalidArgument(f"{where}: missing field(s) {', '.join(missing)}; "
                              f"each line needs {', '.join(_FIELDS)}")
    timestamp = obj["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) \
            or not math.isfinite(timestamp) or timestamp < 0:
        raise InvalidArgument(f"{where}: timestamp must be a finite number of ms >= 0, "
                              f"got {timestamp!r}")
    input_length = obj["input_length"]
    if not _is_int(input_length) or input_length < 1:
        raise InvalidArgument(f"{where}: input_length must be an int >= 1, got {input_length!r}")
    output_length = obj["output_length"]
    if not _is_int(output_length) or output_length < 0:
        raise InvalidArgument(f"{where}: output_length must be an int >= 0, "
                              f"got {output_length!r}")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise InvalidArgument(f"{where}: hash_ids must be a list of ints, "
                              f"got {type(hash_ids).__name__}")
    for position, block in enumerate(hash_ids):
        if not _is_int(block) or block < 0:
            raise InvalidArgument(f"{where}: hash_ids[{position}] must be an int >= 0, "
                                  f"got {block!r}")
    expected = -(-input_length // block_tokens)
    if len(hash_ids) != expected:
        raise InvalidArgument(f"{where}: input_length {input_length} needs {expected} "
                              f"hash_ids of {block_tokens} tokens, got {len(hash_ids)}")
    return TraceRequest(timestamp, input_length, output_length, tuple(hash_ids))


def iter_trace(path: str | os.PathLike[str],
               block_tokens: int = BLOCK_TOKENS) -> Iterator[TraceRequest]:
    """Yield the requests of a JSONL trace file, validating each line as it is read.

    Args:
        path: the trace file, plain or gzip-compressed.
        block_tokens: tokens per block (512 in the Mooncake traces).

    Returns:
        An iterator of :class:`TraceRequest` in file order.

    Raises:
        InvalidArgument: a line is not valid JSON, fails :func:`parse_request`, or arrives
            before the line above it; or a gzipped file is truncated or corrupt.
        OSError: the file cannot be opened or read.
    """
    name = os.fspath(path)
    with open(name, "rb") as raw:
        compressed = raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
        stream: IO[str] = (gzip.open(raw, "rt", encoding="utf-8") if compressed
                           else io.TextIOWrapper(raw, encoding="utf-8"))
        with stream:
            try:
                yield from _parse_lines(stream, name, block_tokens)
            except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
                raise InvalidArgument(f"{name}: corrupt gzip data ({exc})") from None


def _parse_lines(stream: IO[str], name: str, block_tokens: int) -> Iterator[TraceRequest]:
    previous_ms = 0.0
    for line_no, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        where = f"{name}:{line_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{where}: not valid JSON ({exc.msg} at column "
                                  f"{exc.colno})") from None
        request = parse_request(obj, where, block_tokens)
        if request.timestamp_ms < previous_ms:
            raise InvalidArgument(f"{where}: timestamp {request.timestamp_ms} is earlier "
                                  f"than the previous line's {previous_ms}; sort the trace "
                                  f"by timestamp")
        previous_ms = request.timestamp_ms
        yield request


def load_trace(path: str | os.PathLike[str],
               block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """Read a whole trace file into a list (see :func:`iter_trace` for the checks).

    Args:
        path: the trace file, plain or gzip-compressed.
        block_tokens: tokens per block.

    Returns:
        The requests in arrival order.

    Raises:
        InvalidArgument: a line is malformed, or the file holds no request.
        OSError: the file cannot be opened or read.
    """
    requests = list(iter_trace(path, block_tokens))
    if not requests:
        raise InvalidArgument(f"{os.fspath(path)}: the trace holds no request")
    logger.debug("loaded %d requests from %s", len(requests), os.fspath(path))
    return requests
