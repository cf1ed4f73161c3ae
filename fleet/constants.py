"""Every name Fleet puts on the wire or in Redis, and the defaults that go with them.

Subjects use NATS dot notation; the Kafka broker maps them to topic names (see ``fleet.brokers.kafka``).
"""

from __future__ import annotations

import re

# -- subjects -------------------------------------------------------------------------------------------------
SUBJECT_PREFIX = "fleet"
REQ_PREFIX = f"{SUBJECT_PREFIX}.req"
DLQ_PREFIX = f"{SUBJECT_PREFIX}.dlq"
INBOX_PREFIX = f"{SUBJECT_PREFIX}.inbox"
CTL_PREFIX = f"{SUBJECT_PREFIX}.ctl"
HEARTBEAT_PREFIX = f"{CTL_PREFIX}.heartbeat"
IDLE_PREFIX = f"{CTL_PREFIX}.idle"

# JetStream streams: one for requests, one for dead letters.
REQ_STREAM = "FLEET_REQ"
DLQ_STREAM = "FLEET_DLQ"

# Model names become subject tokens, topic names and Redis keys, so they are restricted.
MODEL_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")

# Message headers.
HEADER_MSG_ID = "Nats-Msg-Id"  # JetStream de-duplication header; Kafka uses the message key
HEADER_JOB_ID = "fleet-job-id"
HEADER_MODEL = "fleet-model"
HEADER_ERROR = "fleet-error"
HEADER_DELIVERIES = "fleet-deliveries"


def request_subject(model: str) -> str:
    return f"{REQ_PREFIX}.{model}"


def dlq_subject(model: str) -> str:
    return f"{DLQ_PREFIX}.{model}"


def inbox_subject(worker_id: str) -> str:
    return f"{INBOX_PREFIX}.{worker_id}"


def heartbeat_subject(model: str) -> str:
    return f"{HEARTBEAT_PREFIX}.{model}"


def consumer_name(model: str) -> str:
    """Durable consumer (NATS) or consumer group (Kafka) shared by all workers of a model."""
    return f"fleet-{model}"


# -- Redis keys -----------------------------------------------------------------------------------------------
KEY_PREFIX = "fleet"


def job_key(job_id: str) -> str:
    return f"{KEY_PREFIX}:job:{job_id}"


def done_channel(job_id: str) -> str:
    """Pub/sub channel on which the terminal record of one job is announced."""
    return f"{KEY_PREFIX}:done:{job_id}"


def dag_key(run_id: str) -> str:
    return f"{KEY_PREFIX}:dag:{run_id}"


def scale_key(model: str) -> str:
    return f"{KEY_PREFIX}:scale:{model}"


# -- defaults -------------------------------------------------------------------------------------------------
DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_WAIT_MS = 5
DEFAULT_ACK_WAIT_S = 30.0
DEFAULT_MAX_DELIVERIES = 5
DEFAULT_JOB_TTL_S = 24 * 3600
DEFAULT_DEDUP_WINDOW_S = 120.0
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_MAX_LONG_POLL_S = 60.0
