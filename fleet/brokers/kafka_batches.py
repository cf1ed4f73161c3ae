"""Kafka publishing in record batches, and the key hash that places records on partitions.

* ``murmur2`` is the Java client's key hash (``org.apache.kafka.common.utils.Utils.murmur2``), bit for bit what
  aiokafka's ``DefaultPartitioner`` computes, in about half its time: the key's 32-bit words are unpacked at once and
  masked once per step. ``KeyPartitioner`` gives it to the producer, so a job id lands on the partition that any
  Java-compatible producer (aiokafka, the Java client, librdkafka's ``murmur2_random``) picks for it.
* ``send_batches`` writes many records to one topic as aiokafka record batches (``create_batch`` /
  ``send_batch``): one produce future per batch of a partition instead of one per record, which halves the
  client's CPU per message. The records are the same (key, value, headers), the producer the same idempotent one
  with ``acks=all``, and each record's outcome is reported: a batch is written whole or fails whole.
"""

from __future__ import annotations

import asyncio
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaTimeoutError

SEED = 0x9747B28C
MIX = 0x5BD1E995
MASK = 0xFFFFFFFF
VECTOR_MIN_KEYS = 8  # keys of one length hashed together with numpy from this many on
_words: dict[int, Callable[[bytes], tuple[int, ...]]] = {}  # word count -> struct unpacker of that many words


def murmur2(data: bytes) -> int:
    """The Java client's murmur2 of ``data`` (an unsigned 32-bit value, as aiokafka's ``murmur2`` returns it)."""
    length = len(data)
    h = SEED ^ length
    count = length >> 2
    unpack = _words.get(count)
    if unpack is None:
        unpack = _words.setdefault(count, struct.Struct(f"<{count}I").unpack_from)
    for k in unpack(data):
        k = (k * MIX) & MASK
        k = ((k ^ (k >> 24)) * MIX) & MASK
        h = ((h * MIX) & MASK) ^ k
    tail = length & 3
    if tail:
        base = length - tail
        if tail == 3:
            h ^= data[base + 2] << 16
        if tail >= 2:
            h ^= data[base + 1] << 8
        h = ((h ^ data[base]) * MIX) & MASK
    h ^= h >> 13
    h = (h * MIX) & MASK
    return h ^ (h >> 15)


def murmur2_many(keys: Sequence[bytes]) -> list[int]:
    """``[murmur2(key) for key in keys]``, the keys of one length hashed together as numpy columns (job ids mostly
    share one length): about a quarter of the time a key for a batch of 128."""
    out = [0] * len(keys)
    by_length: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_length.setdefault(len(key), []).append(i)
    for length, idx in by_length.items():
        if len(idx) < VECTOR_MIN_KEYS:
            for i in idx:
                out[i] = murmur2(keys[i])
            continue
        for i, value in zip(idx, _murmur2_rows(b"".join([keys[i] for i in idx]), len(idx), length), strict=True):
            out[i] = value
    return out


def _murmur2_rows(joined: bytes, rows: int, length: int) -> list[int]:
    """murmur2 of each of ``rows`` keys of ``length`` bytes laid end to end in ``joined``; the steps of ``murmur2``
    on uint64 columns (a 32-bit value times MIX stays under 2**63)."""
    data: Any = np.frombuffer(joined, dtype=np.uint8).reshape(rows, length)
    count = length >> 2
    words: Any = np.ascontiguousarray(data[:, : count * 4]).view("<u4").astype(np.uint64)
    h: Any = np.full(rows, SEED ^ length, dtype=np.uint64)
    for j in range(count):
        k = (words[:, j] * MIX) & MASK
        k = ((k ^ (k >> 24)) * MIX) & MASK
        h = ((h * MIX) & MASK) ^ k
    tail = length & 3
    if tail:
        base = length - tail
        if tail == 3:
            h ^= data[:, base + 2].astype(np.uint64) << 16
        if tail >= 2:
            h ^= data[:, base + 1].astype(np.uint64) << 8
        h = ((h ^ data[:, base]) * MIX) & MASK
    h ^= h >> 13
    h = (h * MIX) & MASK
    h ^= h >> 15
    return list(h.tolist())


def partition_of(key: bytes | None, partitions: Sequence[int]) -> int:
    """The partition of ``partitions`` (sorted) that a keyed record goes to; a random one for ``None``."""
    if key is None:
        return random.choice(partitions)
    return partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)]


class KeyPartitioner:
    """``AIOKafkaProducer(partitioner=KeyPartitioner())``: aiokafka's default placement with the faster hash."""

    def __call__(self, key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
        if key is None:
            return random.choice(available or all_partitions)
        return all_partitions[(murmur2(key) & 0x7FFFFFFF) % len(all_partitions)]


@dataclass(slots=True)
class Record:
    """One record for ``send_batches``: its key, value and headers as the producer takes them."""

    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


async def send_batches(
    producer: AIOKafkaProducer, topic: str, records: Sequence[Record], *, timeout_s: float
) -> list[Exception | None]:
    """Write ``records`` to ``topic``, each on its key's partition, in record batches; wait until every batch is
    written or failed, at most ``timeout_s``, and return each record's outcome in order: ``None`` once written, else
    the error of its batch (``KafkaTimeoutError`` when unacknowledged in time: written or not, as a timed-out publish
    on NATS). A record too large for a batch of its own goes alone through ``producer.send``. Cancelling cancels the
    waiting, not batches already handed to the producer."""
    partitions = sorted(await producer.partitions_for(topic))
    hashes = iter(murmur2_many([record.key for record in records if record.key is not None]))
    placed: dict[int, list[int]] = {}
    for i, record in enumerate(records):  # in list order, which each partition keeps
        if record.key is None:
            partition = random.choice(partitions)
        else:
            partition = partitions[(next(hashes) & 0x7FFFFFFF) % len(partitions)]
        placed.setdefault(partition, []).append(i)
    outcomes: list[Exception | None] = [None] * len(records)
    parts = [_hand_over(producer, topic, p, records, idx, outcomes) for p, idx in placed.items()]
    handed = await asyncio.gather(*parts)
    await _await_acks([sent for part in handed for sent in part], outcomes, timeout_s)
    return outcomes


Sent = tuple[list[int], "asyncio.Future[Any]"]  # the indices of a batch's records, and the batch's future


async def _hand_over(
    producer: AIOKafkaProducer,
    topic: str,
    partition: int,
    records: Sequence[Record],
    indices: list[int],
    outcomes: list[Exception | None],
) -> list[Sent]:
    """Batch the records at ``indices`` (all of ``partition``) in order and hand the batches to the producer; the
    records it did not take get their error in ``outcomes``."""
    sent: list[Sent] = []
    members: list[int] = []
    batch = producer.create_batch()
    position = 0
    try:
        for position, i in enumerate(indices):  # noqa: B007 - position names what was not handed over on an error
            record = records[i]
            if _append(batch, record):
                members.append(i)
                continue
            if members:  # full: send it and start the next batch with this record
                sent.append((members, await producer.send_batch(batch, topic, partition=partition)))
                members, batch = [], producer.create_batch()
                if _append(batch, record):
                    members.append(i)
                    continue
            # larger than a batch: the producer sends it as a request of its own (up to max_request_size)
            alone = producer.send(topic, record.value, key=record.key, partition=partition, headers=record.headers)
            sent.append(([i], await alone))
        position = len(indices)
        if members:
            sent.append((members, await producer.send_batch(batch, topic, partition=partition)))
    except Exception as exc:  # not handed over (producer closed, queue full past the timeout): these failed
        for i in [*members, *indices[position:]]:
            outcomes[i] = exc
    return sent


async def _await_acks(sent: list[Sent], outcomes: list[Exception | None], timeout_s: float) -> None:
    """Wait for the batches' acknowledgements, at most ``timeout_s`` (aiokafka itself retries a batch for as long
    as its partition's leader is known, a whole outage of a one-broker cluster), and record each one's outcome."""
    if not sent:
        return
    await asyncio.wait({future for _, future in sent}, timeout=timeout_s)  # the futures are not cancelled
    for members, future in sent:
        if not future.done() or future.cancelled():
            error: BaseException | None = KafkaTimeoutError(f"no acknowledgement within {timeout_s:g}s")
        else:
            error = future.exception()
        if error is not None:
            for i in members:
                outcomes[i] = error if isinstance(error, Exception) else KafkaTimeoutError(repr(error))


def _append(batch: Any, record: Record) -> bool:
    """Add ``record`` to an aiokafka ``BatchBuilder``; False when it does not fit."""
    return batch.append(key=record.key, value=record.value, timestamp=None, headers=record.headers) is not None
