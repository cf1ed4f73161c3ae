"""Redis commands packed by hiredis (C) instead of redis-py's Python loop.

redis-py's asyncio connection builds each command's bytes in Python: one encode call, one length and one join per
argument. A micro-batch's compare-and-set script has about 130 arguments (keys, record values, the expected
values' layout), three such commands a batch, so packing was the largest single cost in a worker's store path
(py-spy: 12 % of its samples). hiredis, installed with ``redis[hiredis]``, packs the same bytes in C. From
redis-py 8 on, ``pack_command`` uses hiredis too, but first encodes every argument through the encoder in a Python
generator: for that script's command the subclass below is still about 6x faster.

``with_hiredis_packing(cls)`` is a subclass of a redis-py connection class (plain, TLS or Unix socket) whose
``pack_command`` uses hiredis while redis-py's encoder is at its defaults (UTF-8, strict). It splits a command
name of several words (``"SCRIPT LOAD"``) as redis-py does, and gives anything hiredis refuses (a ``bool``, a
``None``, text that is not UTF-8) back to redis-py's own packer, so the error raised is the one it always was.
``tests/test_redis_packing.py`` holds the bytes to redis-py's for generated commands.
"""

from __future__ import annotations

from typing import Any, TypeVar

try:
    import hiredis
except ImportError:  # redis-py then packs in Python, as before
    hiredis = None  # type: ignore[assignment]


C = TypeVar("C")


class HiredisPacking:
    """The ``pack_command`` of a redis-py connection, done by hiredis where it gives the same bytes."""

    encoder: Any

    def pack_command(self, *args: Any) -> list[bytes]:
        encoder = self.encoder
        if hiredis is not None and encoder.encoding == "utf-8" and encoder.encoding_errors == "strict":
            first = args[0]
            if (isinstance(first, str) and " " in first) or (isinstance(first, bytes) and b" " in first):
                args = (*first.split(), *args[1:])  # "SCRIPT LOAD" is two arguments, as redis-py sends it
            try:
                return [hiredis.pack_command(args)]
            except Exception:  # redis-py's packer below raises its own error for the same input
                pass
        packed: list[bytes] = super().pack_command(*args)  # type: ignore[misc]
        return packed


_SUBCLASSES: dict[type, type] = {}


def with_hiredis_packing(connection_class: type[C]) -> type[C]:
    """``connection_class`` with ``HiredisPacking``'s ``pack_command`` (the class itself without hiredis); one
    subclass per class."""
    if hiredis is None or issubclass(connection_class, HiredisPacking):
        return connection_class
    if connection_class not in _SUBCLASSES:
        name = f"Hiredis{connection_class.__name__}"
        _SUBCLASSES[connection_class] = type(name, (HiredisPacking, connection_class), {})
    return _SUBCLASSES[connection_class]
