"""Read the first record at given offsets of a topic's partitions, for its timestamp: the queue age on Kafka.

A group's oldest waiting request on a partition is the record at the group's committed offset (acks of this
process's members not committed yet count as committed, as for the lag). ``Peeker`` is a group-less consumer of its
own, started on first use and kept: it assigns the partitions with a backlog, seeks each to its offset, takes the
first record of each (one ``getmany``, bounded by a timeout) and unassigns them again, so it fetches nothing in
between. The timestamp is the record's (``CreateTime``: the publisher's clock, or ``LogAppendTime``: the broker's,
as the topic says). An offset the log no longer holds (retention) reads the earliest record there is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from fleet.brokers.kafka_names import start_client, stop_client
from fleet.errors import BrokerUnavailable


class Peeker:
    """One group-less consumer that reads records at offsets; ``close`` is idempotent."""

    def __init__(self, options: Mapping[str, Any], url: str) -> None:
        self._options = dict(options)
        self._url = url
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()  # one peek at a time: each assigns the consumer's partitions

    async def first_timestamps_ms(self, offsets: Mapping[TopicPartition, int], timeout_s: float) -> list[int]:
        """The timestamp (unix ms) of the record at or after each offset that arrives within ``timeout_s``."""
        if not offsets:
            return []
        async with self._lock:
            consumer = await self._started()
            consumer.assign(list(offsets))
            try:
                for tp, offset in offsets.items():
                    consumer.seek(tp, offset)
                return await _first_records(consumer, set(offsets), timeout_s)
            except KafkaError as exc:
                raise BrokerUnavailable(
                    f"Kafka at {self._url}: reading the oldest waiting records failed: {exc!r}"
                ) from exc
            finally:
                consumer.unsubscribe()

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(enable_auto_commit=False, auto_offset_reset="earliest", **self._options)
            try:
                await start_client(consumer.start, consumer.stop)
            except KafkaError as exc:
                raise BrokerUnavailable(f"Kafka at {self._url} does not answer: {exc!r}") from exc
            self._consumer = consumer
        return self._consumer

    async def close(self) -> None:
        async with self._lock:
            consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await stop_client(consumer.stop)


async def _first_records(consumer: AIOKafkaConsumer, wanted: set[TopicPartition], timeout_s: float) -> list[int]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    found: dict[TopicPartition, int] = {}
    while len(found) < len(wanted):
        left_s = deadline - loop.time()
        if left_s <= 0:
            break
        missing = [tp for tp in wanted if tp not in found]
        batch = await consumer.getmany(*missing, timeout_ms=max(1, int(left_s * 1000)), max_records=len(missing))
        for tp, records in batch.items():
            if records and tp not in found:
                found[tp] = records[0].timestamp
    return list(found.values())
