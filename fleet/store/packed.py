"""Packed job records: a record whose output holds base64 vectors is stored with the vectors' bytes, not their text.

A ``base64`` output vector (``fleet.encoding.encode_vector``) is 4/3 the size of its float32 bytes; in the store
it is kept as the bytes themselves, so an ``embed`` record of 384 floats takes about 1,850 bytes instead of 2,350.
The stored value is then

    NUL, the record's JSON, NUL, the vectors' bytes one after the other

where the JSON is the record as ``record_json`` writes it, with each packed field of the output set to null and one
more top-level field, ``"packed"``: ``[[field, length], ...]`` in the order of the bytes, ``length`` the byte count
of one vector or a list of byte counts for a list of vectors. A JSON record never holds a raw NUL (JSON escapes
control characters), so the first byte tells the two forms apart, and ``parse_record`` reads both: what a reader
gets back (``JobRecord``, the REST answers, the WebSocket) is the same record with the same base64 text.

Which values are packed is said by their type: ``encode_vector`` returns a ``Base64Vector`` (a ``str``, to every
other reader plain base64 text), which a worker's output carries into the record. A base64 string that reached the
record another way (a cached answer, a client's) stays text.

Other programs that read ``fleet:job:<id>`` with a Redis client of their own read a float record (the default
``encoding_format``) as plain JSON; for a ``base64`` one, ``python -c`` with ``fleet.store.packed.parse_record`` or
the REST API gives the JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pybase64

from fleet.encoding import Base64Vector
from fleet.schemas.jobs import JobRecord

MARK = b"\x00"
_b64_text = pybase64.b64encode_as_string  # what fleet.encoding.encode_vector writes
_validate_json = JobRecord.model_validate_json
_validate = JobRecord.model_validate


def _layout(output: dict[str, Any]) -> tuple[list[list[Any]], list[bytes]] | None:
    """The ``packed`` entries and the bytes of ``output``'s Base64Vector fields (None when it has none)."""
    layout: list[list[Any]] | None = None
    blobs: list[bytes] = []
    for name, value in output.items():
        if value.__class__ is Base64Vector:
            raw = getattr(value, "raw", None)
            if raw is None:  # made without its bytes: stays text
                continue
            blobs.append(raw)
            entry: list[Any] = [name, len(raw)]
        elif value.__class__ is list and value and value[0].__class__ is Base64Vector:
            raws: list[bytes] = [v.raw for v in value if v.__class__ is Base64Vector and hasattr(v, "raw")]
            if len(raws) != len(value):
                continue  # a mixed list stays text
            blobs += raws
            entry = [name, [len(r) for r in raws]]
        else:
            continue
        if layout is None:
            layout = []
        layout.append(entry)
    return None if layout is None else (layout, blobs)


def pack(values: dict[str, Any], dumps: Callable[[dict[str, Any]], bytes]) -> bytes | None:
    """The packed form of a record's ``values`` (``dumps`` writes the JSON), or None when its output packs nothing.
    ``values`` may be changed: its ``output`` is replaced (by a copy with the packed fields set to null) and a
    ``packed`` entry added."""
    output = values.get("output")
    if output.__class__ is not dict:
        return None
    found = _layout(output)
    if found is None:
        return None
    layout, blobs = found
    head = values
    head["output"] = packed_output = dict(output)
    for name, _ in layout:
        packed_output[name] = None
    head["packed"] = layout
    return b"".join((MARK, dumps(head), MARK, *blobs))


def parse_record(raw: bytes | str) -> JobRecord:
    """A stored record of either form as a ``JobRecord``.

    Raises:
        ValueError: (pydantic's ``ValidationError`` for a JSON record) the value is not a valid job record.
    """
    if isinstance(raw, str) or raw[:1] != MARK:
        return _validate_json(raw)
    data = bytes(raw)
    end = data.find(MARK, 1)
    if end < 0:
        raise ValueError("a packed record without the NUL that ends its JSON")
    try:
        head = orjson.loads(data[1:end])
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"the JSON of a packed record does not parse: {exc}") from None
    layout = head.pop("packed", None) if isinstance(head, dict) else None
    output = head.get("output") if isinstance(head, dict) else None
    if not isinstance(layout, list) or not isinstance(output, dict):
        raise ValueError("a packed record needs an object with an 'output' object and a 'packed' list")
    at = end + 1
    for entry in layout:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"a packed record's layout entry must be [field, length], got {entry!r:.80}")
        name, sizes = entry
        if isinstance(sizes, int) and not isinstance(sizes, bool):
            output[name], at = _text(data, at, sizes), at + sizes
        elif isinstance(sizes, list):
            texts = []
            for size in sizes:
                if not isinstance(size, int) or isinstance(size, bool):
                    raise ValueError(f"a packed record's byte counts must be integers, got {size!r:.40}")
                texts.append(_text(data, at, size))
                at += size
            output[name] = texts
        else:
            raise ValueError(f"a packed record's length must be an integer or a list of them, got {sizes!r:.80}")
    if at != len(data):
        held, said = len(data) - end - 1, at - end - 1
        raise ValueError(f"a packed record holds {held} bytes of vectors, its layout says {said}")
    return _validate(head)


def _text(data: bytes, at: int, size: int) -> str:
    if size < 0 or at + size > len(data):
        raise ValueError(f"a packed record's layout runs past its {len(data)} bytes")
    return _b64_text(memoryview(data)[at : at + size])
