"""The one place that maps an item's outcome to ack, retry or dead-letter. Pure and table-tested.

``attempt`` counts the runs of a job that count against it (its strikes, kept in its record by the store:
``fleet.consumers.crashes``), not the broker's deliveries: a delivery that never reached the model, because the store or
the broker was away, is nobody's failure, nor is a worker killed while it computed many jobs. The broker's own
count only backs a poison cap (``poisoned``) for a message that kills its worker before it can even start.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fleet.schemas.jobs import JobError, JobState


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


POISON_FACTOR = 20  # deliveries per allowed attempt after which a message that never starts is poison


def decide(error: JobError | None, attempt: int, max_deliveries: int) -> Decision:
    """What to do with a message whose item ended with ``error`` (``None``: it succeeded) on run ``attempt``."""
    if error is None:
        return Decision(Action.ack)
    if not error.retriable or attempt >= max_deliveries:
        return Decision(Action.dead_letter)
    return Decision(Action.retry, retry_delay_s(attempt))


def for_stored(state: JobState) -> Action:
    """What to do with a message whose job's terminal record is stored: a ``failed`` job (re)sends its dead
    letter (an earlier send may not have happened; the letter's message id de-duplicates a repeat), the rest ack."""
    return Action.dead_letter if state is JobState.failed else Action.ack


def poisoned(delivery_count: int, max_deliveries: int) -> bool:
    """A message delivered far more often than its runs allow: it stops its worker before it can start."""
    return delivery_count > POISON_FACTOR * max_deliveries
