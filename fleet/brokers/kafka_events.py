"""Best-effort control events over Kafka: every subject shares the topic ``fleet.ctl``, the subject is the key.

A listener is a group-less consumer assigned every partition of that topic from its current end, so it sees the
events emitted after ``listen`` returned and filters them by the NATS-style pattern it was given.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import ConsumerStoppedError, KafkaError

from fleet import constants as c
from fleet.brokers.kafka_names import start_client, stop_client
from fleet.brokers.subjects import subject_matches
from fleet.errors import BrokerUnavailable

log = logging.getLogger(__name__)

EVENTS_TOPIC = c.CTL_PREFIX  # "fleet.ctl"
POLL_TIMEOUT_MS = 1000


class KafkaEventStream:
    """``async for subject, data in stream`` over matching control events; ``await stream.close()`` ends it."""

    def __init__(
        self, pattern: str, client_options: dict[str, Any], *, on_close: Callable[[KafkaEventStream], None]
    ) -> None:
        self.pattern = pattern
        self._consumer = AIOKafkaConsumer(enable_auto_commit=False, **client_options)
        self._buffer: deque[tuple[str, bytes]] = deque()
        self._on_close = on_close
        self._closed = False
        self._stopped = False

    async def start(self, partitions: int) -> None:
        await start_client(self._consumer.start, self._consumer.stop)  # stopped again on any error or cancellation
        tps = [TopicPartition(EVENTS_TOPIC, p) for p in range(partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_end(*tps)
        for tp in tps:  # resolve the positions now, so nothing emitted after listen() returns is missed
            await self._consumer.position(tp)

    def __aiter__(self) -> KafkaEventStream:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        while not self._buffer:
            if self._closed:
                raise StopAsyncIteration
            await self._poll()
        return self._buffer.popleft()

    async def _poll(self) -> None:
        try:
            batches = await self._consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
        except ConsumerStoppedError:
            self._closed = True
            return
        except KafkaError as exc:
            raise BrokerUnavailable(f"reading control events failed: {exc!r}") from exc
        for records in batches.values():
            for record in records:
                subject = record.key.decode(errors="replace") if record.key else ""
                if subject_matches(self.pattern, subject):
                    self._buffer.append((subject, record.value or b""))

    async def close(self) -> None:
        self._closed = True
        self._buffer.clear()
        if not self._stopped:
            self._stopped = True
            self._on_close(self)
            await stop_client(self._consumer.stop)

    def __del__(self, _warnings: Any = warnings) -> None:
        if not getattr(self, "_stopped", True):
            _warnings.warn(f"unclosed KafkaEventStream on {self.pattern!r}", ResourceWarning, source=self, stacklevel=1)
