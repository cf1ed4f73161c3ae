"""The one place that maps an item's outcome to ack, retry or dead-letter. Pure and table-tested."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from schemas.jobs import JobError


class Action(StrEnum):
    ack = "ack"  # terminal result stored: settle the message
    retry = "retry"  # transient failure: nak, deliver again later
    dead_letter = "dead_letter"  # store 'failed', publish to the dead-letter subject, then settle


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    delay_s: float = 0.0


def retry_delay_s(delivery_count: int, base_s: float = 0.5, cap_s: float = 30.0) -> float:
    """Exponential backoff between redeliveries of a failing item: 0.5 s, 1 s, 2 s ... capped."""
    return min(cap_s, base_s * 2 ** max(0, delivery_count - 1))


def decide(error: JobError | None, delivery_count: int, max_deliveries: int) -> Decision:
    """What to do with a message whose item ended with ``error`` (``None``: it succeeded) on this delivery."""
    if error is None:
        return Decision(Action.ack)
    if not error.retriable or delivery_count >= max_deliveries:
        return Decision(Action.dead_letter)
    return Decision(Action.retry, retry_delay_s(delivery_count))


def exhausted(delivery_count: int, max_deliveries: int) -> bool:
    """A message delivered more often than allowed without an outcome (the worker died on it each time)."""
    return delivery_count > max_deliveries
