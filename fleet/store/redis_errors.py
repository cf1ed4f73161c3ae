"""What the Redis-backed side stores (DAG runs, dead letters) share: Redis failures as ``StoreError``, and text.

``redis`` is imported only when a failure is being translated, so a process on the memory store never loads it.
"""

from __future__ import annotations

from typing import Any

from fleet.errors import StoreError


class RedisErrors:
    """``async with RedisErrors("DAG store", url, "read run r1")``: a Redis, socket or timeout failure inside
    becomes ``StoreError("DAG store at <url> could not read run r1: ...")`` (retriable)."""

    def __init__(self, what: str, url: str, action: str) -> None:
        self.what, self.url, self.action = what, url, action

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        from redis.exceptions import RedisError

        if isinstance(exc, RedisError | OSError | TimeoutError):
            raise StoreError(f"{self.what} at {self.url} could not {self.action}: {exc}") from exc
        return False


def text(value: str | bytes) -> str:
    """A Redis reply as text (a client without ``decode_responses`` answers bytes)."""
    return value.decode() if isinstance(value, bytes) else value
