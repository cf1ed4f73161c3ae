"""Recorded dead letters: what the gateway's recorder read from ``fleet.dlq.<model>``, kept for the operator to
list, redrive or purge. In Redis next to the job records, or in memory for ``fleet up``.

Contract (``tests/test_deadletter_store.py`` runs it on Redis and in memory):

* ``add(letter_id, letter)`` stores a letter once: a second add of the same id changes nothing and answers False
  (the recorder's redelivered message).
* ``counts()`` is letters held per model; ``latest(model, limit)`` the newest first (by the time the job failed).
* ``take(ids)`` removes the named letters and returns those this call removed, so two operators redriving the same
  letter at once redrive it once; ``put_back`` stores taken letters again (a redrive whose publish failed).
* ``ids(model, limit)`` lists a model's letter ids, newest first.

Redis keys (``fleet.constants``): ``dead_letter_key(id)`` the letter (a TTL of ``DEAD_LETTER_TTL_S``),
``dead_letter_index_key(model)`` a sorted set of ids by failure time, ``DEAD_LETTER_MODELS_KEY`` the models.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fleet import constants as c
from fleet.schemas.wire import DeadLetter
from fleet.store.redis_errors import RedisErrors, text

if TYPE_CHECKING:
    from fleet.store.redis import RedisStore


@dataclass(frozen=True, slots=True)
class StoredLetter:
    letter_id: str
    letter: DeadLetter

    @property
    def model(self) -> str:
        return self.letter.model

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "letter": self.letter.model_dump(mode="json")})

    @classmethod
    def from_json(cls, letter_id: str, raw: str | bytes) -> StoredLetter:
        body = json.loads(raw)
        return cls(letter_id, DeadLetter.model_validate(body["letter"]))


class DeadLetterStore(Protocol):
    async def add(self, letter_id: str, letter: DeadLetter) -> bool: ...

    async def counts(self) -> dict[str, int]: ...

    async def latest(self, model: str, limit: int) -> list[StoredLetter]: ...

    async def ids(self, model: str, limit: int) -> list[str]: ...

    async def take(self, letter_ids: list[str]) -> list[StoredLetter]: ...

    async def put_back(self, letters: list[StoredLetter]) -> None: ...


class MemoryDeadLetterStore:
    """The in-memory store of ``fleet up``: one per memory result store."""

    def __init__(self) -> None:
        self._letters: dict[str, StoredLetter] = {}

    async def add(self, letter_id: str, letter: DeadLetter) -> bool:
        if letter_id in self._letters:
            return False
        self._letters[letter_id] = StoredLetter(letter_id, letter)
        return True

    async def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for stored in self._letters.values():
            out[stored.model] = out.get(stored.model, 0) + 1
        return dict(sorted(out.items()))

    async def latest(self, model: str, limit: int) -> list[StoredLetter]:
        mine = [s for s in self._letters.values() if s.model == model]
        mine.sort(key=lambda s: s.letter.failed_at, reverse=True)
        return mine[:limit]

    async def ids(self, model: str, limit: int) -> list[str]:
        return [s.letter_id for s in await self.latest(model, limit)]

    async def take(self, letter_ids: list[str]) -> list[StoredLetter]:
        return [taken for i in dict.fromkeys(letter_ids) if (taken := self._letters.pop(i, None)) is not None]

    async def put_back(self, letters: list[StoredLetter]) -> None:
        for stored in letters:
            self._letters[stored.letter_id] = stored


class RedisDeadLetterStore:
    """The dead letters in the Redis of ``store`` (a ``RedisStore``: its client)."""

    def __init__(self, store: RedisStore) -> None:
        self.redis = store.redis
        self.display_url = store.display_url

    async def add(self, letter_id: str, letter: DeadLetter) -> bool:
        stored = StoredLetter(letter_id, letter)
        async with self._errors("record a dead letter"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(c.dead_letter_key(letter_id), stored.to_json(), nx=True, ex=c.DEAD_LETTER_TTL_S)
                pipe.zadd(c.dead_letter_index_key(letter.model), {letter_id: letter.failed_at})
                pipe.sadd(c.DEAD_LETTER_MODELS_KEY, letter.model)
                created, _, _ = await pipe.execute()
        return bool(created)

    async def counts(self) -> dict[str, int]:
        cutoff = time.time() - c.DEAD_LETTER_TTL_S
        async with self._errors("count the dead letters"):
            models = sorted(text(m) for m in await self.redis.smembers(c.DEAD_LETTER_MODELS_KEY))
            async with self.redis.pipeline(transaction=False) as pipe:
                for model in models:
                    pipe.zremrangebyscore(c.dead_letter_index_key(model), "-inf", cutoff)
                    pipe.zcard(c.dead_letter_index_key(model))
                replies = await pipe.execute()
        return {model: int(replies[2 * i + 1]) for i, model in enumerate(models) if replies[2 * i + 1]}

    async def ids(self, model: str, limit: int) -> list[str]:
        async with self._errors("list the dead letters"):
            found = await self.redis.zrevrange(c.dead_letter_index_key(model), 0, max(0, limit - 1))
        return [text(i) for i in found]

    async def latest(self, model: str, limit: int) -> list[StoredLetter]:
        ids = await self.ids(model, limit)
        if not ids:
            return []
        async with self._errors("read the dead letters"):
            raws = await self.redis.mget([c.dead_letter_key(i) for i in ids])
            gone = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
            if gone:  # expired: drop them from the index
                await self.redis.zrem(c.dead_letter_index_key(model), *gone)
        return [StoredLetter.from_json(i, raw) for i, raw in zip(ids, raws, strict=True) if raw is not None]

    async def take(self, letter_ids: list[str]) -> list[StoredLetter]:
        ids = list(dict.fromkeys(letter_ids))
        if not ids:
            return []
        async with self._errors("take dead letters"):
            async with self.redis.pipeline(transaction=True) as pipe:
                for letter_id in ids:
                    pipe.get(c.dead_letter_key(letter_id))
                    pipe.delete(c.dead_letter_key(letter_id))
                replies = await pipe.execute()
            taken = [
                StoredLetter.from_json(i, replies[2 * n])
                for n, i in enumerate(ids)
                if replies[2 * n] is not None and replies[2 * n + 1]
            ]
            async with self.redis.pipeline(transaction=False) as pipe:
                for stored in taken:
                    pipe.zrem(c.dead_letter_index_key(stored.model), stored.letter_id)
                await pipe.execute()
        return taken

    async def put_back(self, letters: list[StoredLetter]) -> None:
        for stored in letters:
            await self.add(stored.letter_id, stored.letter)

    def _errors(self, action: str) -> Any:
        return RedisErrors("dead-letter store", self.display_url, action)
