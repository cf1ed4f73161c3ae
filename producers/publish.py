"""``fleet publish``: send requests from a JSON Lines file straight to a model's subject.

Each line is one model input (``{"text": "hello"}`` for embed), or with ``requests=True`` one complete wire
message (``fleet.schemas.wire.RequestMessage``). Inputs are validated against the model's schema before anything is
sent; job ids are printed in input order.

``tenant`` names the tenant the jobs belong to (``RequestMessage.tenant``; None: the default tenant): input lines
get it, request lines that name no tenant get it, and a request line naming another tenant is an invalid line.
A request line may not name a job id of the shape reserved for DAG steps (``fleet.schemas.dags.STEP_JOB_ID_PATTERN``)
nor carry a ``dag`` context: those are the DAG runner's.
The broker does not check the field: what keeps a producer to its own tenant is the broker's permissions on the
subjects (README, "Broker permissions").
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fleet import constants as c
from fleet import strict_json, tenancy
from fleet.brokers.base import Broker, Outgoing
from fleet.encoding import ENCODING_FORMATS, no_vectors_message
from fleet.errors import InvalidInput
from fleet.schemas.dags import STEP_JOB_ID_PATTERN, STEP_JOB_ID_RULE
from fleet.schemas.models import ModelSpec
from fleet.schemas.wire import TENANT_PATTERN, RequestMessage, to_priority

_STEP_JOB_ID_RE = re.compile(STEP_JOB_ID_PATTERN)


@dataclass(slots=True)
class LineError:
    line: int
    message: str


@dataclass(slots=True)
class Prepared:
    messages: list[RequestMessage] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)


def _describe(exc: ValidationError, prefix: str) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in (prefix, *e['loc']) if p != '')}: {e['msg']}" for e in exc.errors())


def check_priority(value: str) -> str:
    """A priority name from a name or an integer's text (``"2"``); ``InvalidInput`` saying what is accepted."""
    try:
        return to_priority(int(value) if value.lstrip("-").isdigit() else value)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def check_tenant(value: str | None) -> str | None:
    """``value``, checked; ``InvalidInput`` for a malformed tenant name."""
    if value is None:
        return None
    if not re.match(TENANT_PATTERN, value):
        raise InvalidInput(
            f"tenant {value[:80]!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return value


def check_encoding(value: str, spec: ModelSpec) -> str:
    """``float`` or ``base64`` (base64 only for a model with vector outputs); ``InvalidInput`` saying why not."""
    if value not in ENCODING_FORMATS:
        raise InvalidInput(f"encoding_format must be 'float' or 'base64', got {value[:64]!r}")
    if value != "float" and not spec.vector_fields:
        raise InvalidInput(no_vectors_message(spec.name))
    return value


def prepare_line(
    text: str,
    spec: ModelSpec,
    *,
    requests: bool,
    priority: str = "normal",
    encoding_format: str = "float",
    tenant: str | None = None,
) -> RequestMessage:
    """One JSONL line → a validated request. Raises ``InvalidInput`` with a message naming the problem."""
    try:
        body = strict_json.loads(text, "the line")  # a value JSON cannot carry exactly is refused, not changed
    except strict_json.JsonRefused as exc:
        raise InvalidInput(exc.message) from None
    if not isinstance(body, dict):
        raise InvalidInput("each line must be a JSON object")
    if not requests:
        body = {"job_id": uuid.uuid4().hex, "model": spec.name, "input": body, "priority": priority}
        if encoding_format != "float":
            body["encoding_format"] = encoding_format
    if tenant is not None:
        named = body.get("tenant")
        if named is None and tenancy.stored(tenant) is not None:
            body["tenant"] = tenancy.stored(tenant)
        elif named is not None and (not isinstance(named, str) or tenancy.owner(named) != tenant):
            raise InvalidInput(f"request names tenant {str(named)[:80]!r}, not {tenant!r} (--tenant)")
    try:
        message = RequestMessage.model_validate(body)
        spec.input_model.model_validate(message.input)
    except ValidationError as exc:
        raise InvalidInput(_describe(exc, "" if requests else "input")) from None
    if message.model != spec.name:
        raise InvalidInput(f"request names model {message.model!r}, not {spec.name!r}")
    if _STEP_JOB_ID_RE.match(message.job_id) or message.dag is not None:
        raise InvalidInput(STEP_JOB_ID_RULE if message.dag is None else "the dag context is the DAG runner's alone")
    if message.encoding_format != "float" and not spec.vector_fields:
        raise InvalidInput(no_vectors_message(spec.name))
    return message


def prepare(
    lines: Iterable[str],
    spec: ModelSpec,
    *,
    requests: bool = False,
    priority: str = "normal",
    encoding_format: str = "float",
    tenant: str | None = None,
) -> Prepared:
    """Every non-blank line as a validated request (``prepare_line``), and the problems of the others."""
    prepared = Prepared()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            line = prepare_line(
                text, spec, requests=requests, priority=priority, encoding_format=encoding_format, tenant=tenant
            )
            prepared.messages.append(line)
        except InvalidInput as exc:
            prepared.errors.append(LineError(number, exc.message))
    return prepared


def read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


async def publish_all(
    broker: Broker,
    messages: list[RequestMessage],
    *,
    concurrency: int = 256,
    on_published: Callable[[], None] | None = None,
) -> list[str]:
    """Publish every message to its model's subject (of its priority) with the job id as message id; return the job
    ids.

    About ``concurrency`` messages await their broker acknowledgement at once: a fixed pool of publishers shares the
    list (a million-line file costs no million waiting tasks). A broker with ``publish_many`` (Kafka) gets the
    list in slices of ``concurrency // 2``, two slices in flight, each written in record batches. Raises the first
    ``BrokerError`` and stops the rest (already-acknowledged messages stay published; re-running is safe thanks to
    de-duplication as long as the same job ids are used).
    """
    many = getattr(broker, "publish_many", None)
    if many is not None:
        await _publish_slices(many, messages, max(1, concurrency // 2), on_published)
        return [message.job_id for message in messages]
    pending = iter(messages)

    async def publisher() -> None:
        for message in pending:  # the shared iterator hands each message to exactly one publisher
            await broker.publish(
                c.request_subject(message.model, message.priority),
                message.model_dump_json().encode(),
                msg_id=message.job_id,
                headers=_headers(message),
            )
            if on_published is not None:
                on_published()

    await _all_or_first_error([publisher() for _ in range(max(1, min(concurrency, len(messages))))])
    return [message.job_id for message in messages]


async def _publish_slices(
    many: Callable[[list[Outgoing]], Awaitable[None]],
    messages: list[RequestMessage],
    size: int,
    on_published: Callable[[], None] | None,
) -> None:
    starts = iter(range(0, len(messages), size))

    async def publisher() -> None:
        for start in starts:
            part = messages[start : start + size]
            await many([_outgoing(message) for message in part])
            if on_published is not None:
                for _ in part:
                    on_published()

    await _all_or_first_error([publisher() for _ in range(2)])


async def _all_or_first_error(publishers: list[Coroutine[Any, Any, None]]) -> None:
    try:
        async with asyncio.TaskGroup() as group:
            for publisher in publishers:
                group.create_task(publisher)
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None  # the broker's own error, as from a single publish


def _outgoing(message: RequestMessage) -> Outgoing:
    subject = c.request_subject(message.model, message.priority)
    return Outgoing(subject, message.model_dump_json().encode(), message.job_id, _headers(message))


def _headers(message: RequestMessage) -> dict[str, str]:
    # No record is made here: the header tells the worker not to read one at its first delivery (it creates it).
    return {c.HEADER_JOB_ID: message.job_id, c.HEADER_MODEL: message.model, c.HEADER_RECORD: c.RECORD_NONE}
