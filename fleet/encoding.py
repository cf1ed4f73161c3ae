"""Compact results: vector outputs as base64 of little-endian float32, as the OpenAI embeddings API returns them.

A request's ``encoding_format`` is ``"float"`` (the default: vectors are JSON arrays of numbers) or ``"base64"``
(each vector is one string, ``base64(numpy.asarray(v, '<f4').tobytes())``: 384 floats take 2,048 characters
instead of about 8,000). Which output fields are vectors is the model's to say (``ModelSpec.vector_fields``); a
field holds either one vector (``embedding``) or a list of them (``embeddings``), and this module converts both
ways between the two forms. Converting is exact: the floats are float32 values to begin with.

Pure functions, used by the worker (encode), the gateway's caches (convert a cached answer to the encoding asked
for) and the SDK (decode, so its users get floats back whatever the encoding on the wire). numpy is imported only
where an array is asked for or given (``decode_array``, an array to encode): the client install has no numpy.
"""

from __future__ import annotations

import base64
import binascii
import functools
import struct
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import pybase64

if TYPE_CHECKING:
    import numpy as np

EncodingFormat = Literal["float", "base64"]
ENCODING_FORMATS: tuple[str, ...] = ("float", "base64")
DEFAULT_ENCODING: EncodingFormat = "float"
# Standard base64 with padding, as text: the characters binascii.b2a_base64 writes, by pybase64's SIMD encoder
# (0.4 µs for 384 floats against 3 µs; in a zero-cost embed worker binascii was 6 % of every instruction).
_b64_text = pybase64.b64encode_as_string


def no_vectors_message(model: str) -> str:
    """Why a model without vector outputs refuses ``encoding_format: base64`` (gateway and worker say the same)."""
    return (
        f"encoding_format 'base64' applies to vector outputs, and model {model!r} has none; "
        "send encoding_format 'float' (the default) or leave it out"
    )


class Base64Vector(str):
    """A vector as base64 of its little-endian float32 bytes, as ``encode_vector`` made it: to every reader plain
    base64 text; ``raw`` holds the bytes themselves, which the result store keeps instead (``fleet.store.packed``)."""

    raw: bytes


@functools.lru_cache(maxsize=64)
def _packer(length: int) -> struct.Struct:
    return struct.Struct(f"<{length}f")


def encode_vector(vector: Any) -> Base64Vector:
    """One vector (a sequence of numbers or a 1-D array) as base64 of its little-endian float32 bytes.

    A list of floats (what a model's ``tolist()`` gives) is packed by ``struct``, three times faster than through
    a numpy array; anything else, or a list ``struct`` refuses (a value past float32's range, a string), goes
    through ``numpy.asarray(vector, '<f4')``, so the bytes are the same either way.
    """
    if isinstance(vector, list):
        try:
            raw = _packer(len(vector)).pack(*vector)
        except (struct.error, OverflowError):
            raw = _float32_bytes(vector)
    else:
        raw = _float32_bytes(vector)
    vector = Base64Vector(_b64_text(raw))
    vector.raw = raw
    return vector


def _float32_bytes(vector: Any) -> bytes:
    import numpy as np

    return np.asarray(vector, dtype="<f4").tobytes()


def _decode_raw(text: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not a base64 vector: {exc}") from None
    if len(raw) % 4:
        raise ValueError(f"a base64 vector holds whole float32 values (4 bytes each), got {len(raw)} bytes")
    return raw


def decode_array(text: str) -> np.ndarray:
    """A base64 vector as a read-only float32 numpy array (no copy); needs numpy (the ``worker`` extra has it).

    Raises:
        ValueError: ``text`` is not base64, or its length is not a whole number of float32 values.
    """
    import numpy as np

    return np.frombuffer(_decode_raw(text), dtype="<f4")


def decode_vector(text: str) -> list[float]:
    """The floats of a base64 vector (the inverse of ``encode_vector``); raises ``ValueError`` as ``decode_array``.
    Unpacked by ``struct``, without numpy: each float32 becomes the Python float of the same value."""
    raw = _decode_raw(text)
    return list(_packer(len(raw) // 4).unpack(raw))


def _is_array(value: Any) -> bool:
    """``value`` is a numpy array (only possible once something imported numpy)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def _to_base64(value: Any) -> Any:
    if isinstance(value, str) or value is None:
        return value
    if _is_array(value):
        return encode_vector(value) if value.ndim == 1 else [encode_vector(row) for row in value]
    if value and not isinstance(value[0], (int, float)):  # a list of vectors
        return [v if isinstance(v, str) else encode_vector(v) for v in value]
    return encode_vector(value)


def _to_float(value: Any) -> Any:
    if isinstance(value, str):
        return decode_vector(value)
    if isinstance(value, list) and value and isinstance(value[0], str):
        return [decode_vector(v) if isinstance(v, str) else v for v in value]
    if _is_array(value):
        return value.tolist()
    return value


def convert_output(output: Any, fields: Iterable[str], encoding: str) -> Any:
    """``output`` (a model's JSON output) with its vector ``fields`` in ``encoding``; anything else unchanged.

    A field may already be in either form (a cached answer filled by a request of the other encoding): it is
    converted when it must be, left as it is when it is already right. The input is not modified.

    Raises:
        ValueError: a field said to be base64 does not decode.
    """
    if not isinstance(output, dict):
        return output
    convert = _to_base64 if encoding == "base64" else _to_float
    changed = None
    for name in fields:
        if name in output and output[name] is not None:
            if changed is None:
                changed = dict(output)
            changed[name] = convert(output[name])
    return output if changed is None else changed


def decode_output(output: Any, fields: Iterable[str]) -> Any:
    """``output`` with every base64 vector in ``fields`` decoded to floats (``convert_output(..., "float")``)."""
    return convert_output(output, fields, "float")
