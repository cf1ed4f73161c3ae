"""The async Python client of the Fleet gateway.

Example::

    async with FleetClient("http://127.0.0.1:8000") as fleet:
        job_id = await fleet.submit("embed", {"text": "hello"})
        record = await fleet.wait(job_id, timeout_s=30)
        async for record in fleet.subscribe([id1, id2]):
            ...
        name, version = await fleet.register_dag(Path("dags/examples/chain.yaml").read_text())
        run_id = await fleet.start_run(name, {"value": 42})
        async for event in fleet.run_events(run_id):  # {"type": "run" | "step" | "result", "run": {...}}
            ...
        run = await fleet.wait_run(run_id, timeout_s=60)  # run["state"], run["output"]
        answer = await fleet.submit_many([{"model": "embed", "input": {"text": t}} for t in texts])
        async for job in fleet.iter_jobs(model="embed", state="failed", since=time.time() - 3600):
            ...

Every error answer of the gateway becomes a ``fleet.errors`` exception carrying the server's message:
``UnknownModel``, ``InvalidInput``, ``PayloadTooLarge``, ``JobNotFound``, ``BrokerUnavailable``, ``StoreError``,
``DagInvalid`` (``problems``: step, path, message), ``UnknownDag``, ``UnknownRun``;
any other error answer becomes ``GatewayError`` (with ``status`` and ``type``), a gateway that cannot be reached
``GatewayUnreachable``, and a job that ended without success ``JobFailed``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote

import httpx
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from fleet.constants import JOB_BATCH_MAX_ITEMS, JOB_LIST_DEFAULT_LIMIT
from fleet.encoding import EncodingFormat, decode_array, decode_output, decode_vector
from fleet.errors import (
    BrokerUnavailable,
    DagInvalid,
    FleetError,
    InvalidInput,
    JobNotFound,
    PayloadTooLarge,
    QueueFull,
    StoreError,
    UnknownDag,
    UnknownModel,
    UnknownRun,
)
from fleet.producers.sdk_http import GatewayUnreachable, make_http
from fleet.schemas.api import BatchItemResult, BatchResponse, JobPage, JobSummary
from fleet.schemas.jobs import JobRecord, JobState
from fleet.schemas.usage import UsageReport
from fleet.tracing.caller import trace_headers

__all__ = [
    "FleetClient",
    "GatewayError",
    "GatewayUnreachable",
    "InferTimeout",
    "JobFailed",
    "decode_array",
    "decode_output",
    "decode_vector",
    "error_from_response",
]

DEFAULT_LONG_POLL_S = 20.0  # each long-poll of wait(); must not exceed the gateway's max_long_poll_s (60 s)

# A job's priority: a name, or an integer of -9..9 mapped by sign (> 0 high, 0 normal, < 0 low); see submit.
PriorityArg = Literal["high", "normal", "low"] | int
SUBSCRIBE_IDS_PER_FRAME = 100  # the gateway's default ws_max_ids_per_frame
RETRY_FIRST_S = 0.1  # first pause of wait/subscribe after a retriable failure
RETRY_MAX_S = 2.0  # and the longest
# The output fields the client decodes from base64 (embed's); a model of your own with other names: vector_fields=
DEFAULT_VECTOR_FIELDS = ("embedding", "embeddings")


def request_json(body: Any) -> bytes:
    """``body`` as the JSON a request carries, refusing what JSON cannot carry exactly (the gateway would answer
    422): NaN and infinite floats, integers of more than 4300 digits.

    Raises:
        InvalidInput: naming what could not be sent.
    """
    try:
        return json.dumps(body, allow_nan=False).encode()
    except ValueError as exc:  # "Out of range float values are not JSON compliant", "Exceeds the limit (4300 ..."
        raise InvalidInput(
            f"the request cannot be sent as JSON: {exc} (NaN and Infinity are not JSON numbers)"
        ) from None


class GatewayError(FleetError):
    """An error answer that has no more specific exception (conflicts, server errors...)."""

    def __init__(self, status: int, type_: str, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.details = details
        self.retriable = status >= 500


class InferTimeout(FleetError):
    """``infer`` waited its ``wait_s`` and the job had not ended; it goes on: ``wait(exc.job_id)`` gets its record."""

    retriable = True

    def __init__(self, job_id: str, state: str, message: str) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.state = state


class JobFailed(FleetError):
    """The job ended ``failed``, ``cancelled`` or ``expired``; ``record`` says why (``record.error``)."""

    def __init__(self, record: JobRecord) -> None:
        why = f": {record.error.type}: {record.error.message}" if record.error else ""
        super().__init__(f"job {record.job_id!r} ended {record.state}{why}")
        self.record = record
        self.retriable = bool(record.error and record.error.retriable)


def _with_message(exc: FleetError, message: str) -> FleetError:
    exc.message = message
    exc.args = (message,)
    return exc


def error_from_response(status: int, body: Any) -> FleetError:
    """The ``fleet.errors`` exception for one gateway error answer (``{"error": {"type", "message", "details"}}``)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return GatewayError(status, f"http_{status}", f"gateway answered {status}: {str(body)[:500]}")
    type_, message, details = str(error.get("type")), str(error.get("message")), error.get("details")
    info = details if isinstance(details, dict) else {}
    exc: FleetError
    if type_ == "unknown_model":
        exc = UnknownModel(str(info.get("model", "")), list(info.get("known", [])))
    elif type_ in ("invalid_input", "invalid_request", "malformed_json") and "record" not in info:
        exc = InvalidInput(message, details if isinstance(details, list) else [])
    elif type_ == "payload_too_large":
        exc = PayloadTooLarge(int(info.get("size", 0)), int(info.get("limit", 0)))
    elif type_ in ("dag_invalid", "malformed_spec"):
        exc = DagInvalid(details if isinstance(details, list) else [])
    elif type_ == "dag_not_found":
        exc = UnknownDag(str(info.get("name", "")))
    elif type_ == "run_not_found":
        exc = UnknownRun(str(info.get("run_id", "")))
    elif type_ == "job_not_found":
        exc = JobNotFound(str(info.get("job_id", "")))
    elif type_ == "queue_full":
        limit, depth, wait_s = info.get("limit"), info.get("depth"), info.get("retry_after_s")
        exc = QueueFull(str(info.get("model", "")), limit, depth=depth, retry_after_s=wait_s)
    elif type_ in ("job_failed", "job_cancelled", "job_expired") and isinstance(info.get("record"), dict):
        exc = JobFailed(JobRecord.model_validate(info["record"]))
    elif type_ == "invalid_input" and isinstance(info.get("record"), dict):
        exc = JobFailed(JobRecord.model_validate(info["record"]))
    elif type_ == "infer_timeout":
        exc = InferTimeout(str(info.get("job_id", "")), str(info.get("state", "")), message)
    elif type_ == "broker_unavailable":
        exc = BrokerUnavailable(message)
    elif type_ == "store_unavailable":
        exc = StoreError(message)
    else:
        exc = GatewayError(status, type_, message, details)
    return _with_message(exc, message)


def _job_body(
    model: str,
    input: dict[str, Any],
    job_id: str | None,
    timeout_s: float | None,
    priority: PriorityArg,
    encoding_format: EncodingFormat = "float",
) -> dict[str, Any]:
    """The ``POST /v1/jobs`` (and ``/v1/infer``) body."""
    body: dict[str, Any] = {"model": model, "input": input, "priority": priority}
    if encoding_format != "float":  # the default is left out: a gateway older than the field still accepts it
        body["encoding_format"] = encoding_format
    if job_id is not None:
        body["job_id"] = job_id
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    return body


TimeArg = float | datetime | str  # unix seconds, an aware datetime, or an RFC 3339 string


def _time_param(value: TimeArg) -> str:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError(f"a datetime for since/until needs its time zone, got {value!r}")
        return value.isoformat()
    return value if isinstance(value, str) else repr(float(value))


def history_params(
    model: str | None,
    state: str | Iterable[str] | None,
    tenant: str | None,
    since: TimeArg | None,
    until: TimeArg | None,
    cursor: str | None,
    limit: int,
) -> dict[str, str]:
    """The query of ``GET /v1/jobs`` (unset filters left out)."""
    params = {"limit": str(limit)}
    if state is not None:
        params["state"] = state if isinstance(state, str) else ",".join(state)
    for name, value in (("model", model), ("tenant", tenant), ("cursor", cursor)):
        if value is not None:
            params[name] = value
    for name, moment in (("since", since), ("until", until)):
        if moment is not None:
            params[name] = _time_param(moment)
    return params


def ws_url(base_url: str, path: str) -> str:
    """``http://h:p/x`` -> ``ws://h:p/x/<path>`` (``https`` -> ``wss``)."""
    url = httpx.URL(base_url.rstrip("/") + path)
    return str(url.copy_with(scheme="wss" if url.scheme == "https" else "ws"))


class FleetClient:
    """Async client of one Fleet gateway; use it as ``async with FleetClient(url) as fleet``.

    Args:
        base_url: the gateway, e.g. ``http://127.0.0.1:8000``.
        timeout_s: timeout of each HTTP request (long-polls add their wait to it) and of opening a WebSocket.
        transport: an ``httpx.AsyncBaseTransport`` for the REST calls instead of aiohttp's connections (tests pass
            ``httpx.ASGITransport`` to call an app in-process);
            ``subscribe`` always opens a real WebSocket to ``base_url``.
        long_poll_s: the longest single long-poll ``wait`` makes; at most the gateway's ``max_long_poll_s``.
        decode_vectors: True (the default): outputs whose vectors came as base64 (``encoding_format="base64"``)
            are decoded, so every record and output this client returns holds floats, whatever the encoding on
            the wire; False keeps the base64 strings (decode them with ``decode_vector`` / ``decode_array``).
        vector_fields: the output fields decoded (embed's ``embedding`` and ``embeddings``).
        api_key: sent as ``Authorization: Bearer <api_key>`` on every call and WebSocket (``FLEET_AUTH=keys``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 30,
        transport: httpx.AsyncBaseTransport | None = None,
        long_poll_s: float = DEFAULT_LONG_POLL_S,
        decode_vectors: bool = True,
        vector_fields: tuple[str, ...] = DEFAULT_VECTOR_FIELDS,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.long_poll_s = long_poll_s
        self.vector_fields = vector_fields if decode_vectors else ()
        self._http = make_http(self.base_url, transport)

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP connections; idempotent."""
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, timeout_s: float | None = None, **kwargs: Any) -> Any:
        if self._auth:
            kwargs["headers"] = {**self._auth, **(kwargs.get("headers") or {})}
        if traced := trace_headers():  # the caller's current span, when it has one: the gateway joins its trace
            kwargs["headers"] = {**traced, **(kwargs.get("headers") or {})}
        if kwargs.get("json") is not None:  # serialised here, strictly: a value JSON cannot carry is refused now
            kwargs["content"] = request_json(kwargs.pop("json"))
            kwargs["headers"] = {"content-type": "application/json", **(kwargs.get("headers") or {})}
        status, raw = await self._http.request(method, path, timeout_s=timeout_s or self.timeout_s, **kwargs)
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        if status >= 400:
            raise error_from_response(status, body)
        return body

    async def submit(
        self,
        model: str,
        input: dict[str, Any],
        *,
        job_id: str | None = None,
        timeout_s: float | None = None,
        priority: PriorityArg = "normal",
        encoding_format: EncodingFormat = "float",
    ) -> str:
        """Submit one job and return its id once the broker acknowledged it.

        Args:
            model: a served model's name (see ``models()``).
            input: the model input; the gateway validates it against the model's input schema.
            job_id: an idempotency key; submitting the same id again creates no second job.
            timeout_s: a job not started within this many seconds ends ``expired``.
            priority: ``"high"``, ``"normal"`` or ``"low"``; workers take higher levels first (low never starves).
                Integers from -9 to 9 are accepted too and map by sign (> 0 high, 0 normal, < 0 low).
            encoding_format: ``"base64"`` carries and stores each vector of the output as base64 of little-endian
                float32 (4x smaller than printed floats); this client decodes it back to floats (``decode_vectors``).
                A model without vector outputs refuses it (InvalidInput).

        Raises:
            UnknownModel, InvalidInput, PayloadTooLarge: the request is wrong (an unknown priority is an
                InvalidInput: a 422); fix it.
            BrokerUnavailable, StoreError: retriable; the gateway's dependencies are down.
            QueueFull: retriable; the model's queue holds its bound, retry after ``exc.retry_after_s``.
            GatewayUnreachable: retriable; resubmit with the same ``job_id`` to stay idempotent.
        """
        body = _job_body(model, input, job_id, timeout_s, priority, encoding_format)
        answer = await self._request("POST", "/v1/jobs", json=body)
        return str(answer["job_id"])

    async def submit_many(self, jobs: Iterable[Mapping[str, Any]]) -> BatchResponse:
        """Submit many jobs (``POST /v1/jobs:batch``), each a ``POST /v1/jobs`` body (``{"model", "input"}`` and
        optionally ``job_id``, ``timeout_s``, ``priority``, ``cache``, ``encoding_format``), in requests of at most
        ``JOB_BATCH_MAX_ITEMS``. Returns one ``BatchItemResult`` per job, in order (``index`` counts across the
        requests): ``status`` 202 with ``job_id``, or the 4xx/5xx and ``error`` that job alone would have had. A
        refused job never fails the others; resubmitting with the same ``job_id`` values is idempotent per job.

        Raises:
            GatewayError: the request itself was refused (413 for a body over the gateway's batch limit, 401/403).
            GatewayUnreachable: retriable; resubmit with ``job_id`` set on every job to stay idempotent.
        """
        items = [dict(job) for job in jobs]
        results: list[BatchItemResult] = []
        for start in range(0, len(items), JOB_BATCH_MAX_ITEMS):
            answer = BatchResponse.model_validate(
                await self._request("POST", "/v1/jobs:batch", json=items[start : start + JOB_BATCH_MAX_ITEMS])
            )
            results += [r.model_copy(update={"index": r.index + start}) for r in answer.items]
        accepted = sum(1 for r in results if r.status < 300)
        return BatchResponse(items=results, accepted=accepted, refused=len(results) - accepted)

    async def list_jobs(
        self,
        *,
        model: str | None = None,
        state: str | Iterable[str] | None = None,
        tenant: str | None = None,
        since: TimeArg | None = None,
        until: TimeArg | None = None,
        cursor: str | None = None,
        limit: int = JOB_LIST_DEFAULT_LIMIT,
    ) -> JobPage:
        """One page of the job history (``GET /v1/jobs``), newest first; pass ``page.next_cursor`` back as
        ``cursor`` (with the same filters) for the next, until it is None.

        Args:
            model: only this model's jobs. state: one state or several (``"failed"``, ``["queued", "running"]``).
            tenant: another tenant than the key's (the operator token or a default-tenant operator key only).
            since, until: created at or after / before: unix seconds, an aware ``datetime`` or RFC 3339.
            limit: jobs per page, 1 to 500.

        Raises:
            GatewayError: 400 ``invalid_cursor``, 403 ``forbidden`` (another tenant), 422 (a bad filter).
            GatewayUnreachable, StoreError: retriable.
        """
        params = history_params(model, state, tenant, since, until, cursor, limit)
        return JobPage.model_validate(await self._request("GET", "/v1/jobs", params=params))

    async def iter_jobs(self, **filters: Any) -> AsyncIterator[JobSummary]:
        """Every job of the history that matches ``filters`` (``list_jobs``'s), newest first, page after page."""
        cursor = filters.pop("cursor", None)
        while True:
            page = await self.list_jobs(**filters, cursor=cursor)
            for job in page.jobs:
                yield job
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def infer(
        self,
        model: str,
        input: dict[str, Any],
        *,
        wait_s: float = 30.0,
        job_id: str | None = None,
        timeout_s: float | None = None,
        priority: PriorityArg = "normal",
        encoding_format: EncodingFormat = "float",
    ) -> Any:
        """Run one job in one request (``POST /v1/infer``) and return its output.

        Args:
            wait_s: how long the gateway holds the request for the output (at most its ``max_long_poll_s``).
            job_id, timeout_s, priority, encoding_format: as ``submit``.

        Raises:
            InferTimeout: the job had not ended within ``wait_s``; it goes on (``exc.job_id``).
            JobFailed: the job ended failed, cancelled or expired (``exc.record`` has the details).
            UnknownModel, InvalidInput, PayloadTooLarge, QueueFull, BrokerUnavailable, StoreError,
            GatewayUnreachable: as ``submit``.
        """
        answer = await self._request(
            "POST",
            "/v1/infer",
            json=_job_body(model, input, job_id, timeout_s, priority, encoding_format),
            params={"wait": f"{wait_s:g}"},
            timeout_s=wait_s + self.timeout_s,
        )
        return self._decoded(answer["output"])

    def _decoded(self, output: Any) -> Any:
        return decode_output(output, self.vector_fields) if self.vector_fields else output

    def _record(self, data: Any) -> JobRecord:
        """A record from the gateway, its base64 vectors decoded (see ``decode_vectors``)."""
        record = JobRecord.model_validate(data)
        if self.vector_fields and record.output is not None:
            record.output = self._decoded(record.output)
        return record

    async def get(self, job_id: str) -> JobRecord:
        """The job's current record. Raises JobNotFound for an unknown (or expired) id."""
        return self._record(await self._request("GET", f"/v1/jobs/{job_id}"))

    async def wait(self, job_id: str, timeout_s: float = 60.0) -> JobRecord:
        """Long-poll until the job is terminal and return its record (whatever the terminal state).

        An outage of the gateway or of its store shorter than ``timeout_s`` is waited out: a long-poll that fails
        with a retriable error (``StoreError``, ``BrokerUnavailable``, ``GatewayUnreachable``, a 5xx) is retried
        with backoff.

        Raises:
            TimeoutError: the job is still queued or running after ``timeout_s``.
            JobNotFound: unknown id.
            StoreError, GatewayUnreachable, GatewayError: the last attempt before ``timeout_s`` ran out failed.
        """
        record: JobRecord = await self._patiently(
            lambda remaining_s: self._poll_once(job_id, remaining_s),
            lambda record: record.terminal,
            timeout_s,
            lambda record: f"job {job_id!r} is still {record.state} after {timeout_s:g}s",
        )
        return record

    async def _patiently(
        self,
        poll: Callable[[float], Awaitable[Any]],
        done: Callable[[Any], bool],
        timeout_s: float,
        still: Callable[[Any], str],
    ) -> Any:
        """Long-poll with ``poll(remaining_s)`` until ``done``; retriable failures are retried with backoff until
        ``timeout_s``, then the last one is raised; a result still not done then raises ``TimeoutError(still)``."""
        deadline = time.monotonic() + timeout_s
        pause_s = RETRY_FIRST_S
        while True:
            try:
                result = await poll(deadline - time.monotonic())
            except FleetError as exc:
                if not exc.retriable or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(min(pause_s, max(deadline - time.monotonic(), 0.0)))
                pause_s = min(pause_s * 2, RETRY_MAX_S)
                continue
            pause_s = RETRY_FIRST_S
            if done(result):
                return result
            if time.monotonic() >= deadline:
                raise TimeoutError(still(result))

    async def _poll_once(self, job_id: str, remaining_s: float) -> JobRecord:
        step_s = min(self.long_poll_s, remaining_s)
        if step_s <= 0.001:
            return await self.get(job_id)
        answer = await self._request(
            "GET", f"/v1/jobs/{job_id}", params={"wait": f"{step_s:.3f}"}, timeout_s=step_s + self.timeout_s
        )
        return self._record(answer)

    async def result(self, job_id: str, *, timeout_s: float = 60.0) -> Any:
        """Wait for the job and return its output.

        Raises:
            JobFailed: the job ended failed, cancelled or expired (``exc.record`` has the details).
            TimeoutError, JobNotFound: as ``wait``.
        """
        record = await self.wait(job_id, timeout_s)
        if record.state != JobState.succeeded:
            raise JobFailed(record)
        return record.output

    async def run(self, model: str, input: dict[str, Any], *, timeout_s: float = 60.0, **submit_kwargs: Any) -> Any:
        """``submit`` then ``result``: the output of one job. Raises what those raise."""
        job_id = await self.submit(model, input, **submit_kwargs)
        return await self.result(job_id, timeout_s=timeout_s)

    async def cancel(self, job_id: str) -> JobRecord:
        """Cancel a queued or running job. Raises JobNotFound, or GatewayError (409) when it already ended."""
        return self._record(await self._request("POST", f"/v1/jobs/{job_id}/cancel"))

    async def models(self) -> list[dict[str, Any]]:
        """The served models: name, kind, description, batch limits, ``input_schema`` and ``output_schema`` (each
        entry of the gateway's OpenAI-shaped list, which also carries OpenAI's ``id``, ``object``, ``created`` and
        ``owned_by``)."""
        answer = await self._request("GET", "/v1/models")
        return list(answer["data"])

    async def rollout(self, model: str) -> dict[str, Any]:
        """A model's traffic policy, controller state, each version's share, window and breaker, and the latest
        decisions (``GET /v1/models/{model}/rollout``; operator role). Raises GatewayError 404 without a policy."""
        return dict(await self._request("GET", f"/v1/models/{quote(model, safe='')}/rollout"))

    async def promote(self, model: str) -> dict[str, Any]:
        """Promote the model's canary to primary now (operator role); the rollout view after it. Raises
        GatewayError 409 when the model has no canary, 404 without a traffic policy."""
        return dict(await self._request("POST", f"/v1/models/{quote(model, safe='')}/promote"))

    async def rollback(self, model: str) -> dict[str, Any]:
        """Roll the model's canary back to weight 0 now (operator role); the rollout view after it. Raises
        GatewayError 409 when the model has no canary, 404 without a traffic policy."""
        return dict(await self._request("POST", f"/v1/models/{quote(model, safe='')}/rollback"))

    async def get_traffic(self, model: str) -> dict[str, Any]:
        """The model's traffic policy document (operator). Raises GatewayError 404 ``no_traffic_policy`` without
        one, UnknownModel for a model the gateway does not serve."""
        answer: dict[str, Any] = await self._request("GET", f"/v1/models/{model}/traffic")
        return answer

    async def set_traffic(
        self,
        model: str,
        policy: Mapping[str, Any],
        rollout: Mapping[str, Any] | None = None,
        breaker: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Set the model's traffic policy (operator; ``fleet.lifecycle.traffic.TrafficPolicy``'s fields, and the
        optional rollout and breaker configs). Raises InvalidInput (422) naming a bad field or version."""
        body: dict[str, Any] = {"policy": dict(policy)}
        if rollout is not None:
            body["rollout"] = dict(rollout)
        if breaker is not None:
            body["breaker"] = dict(breaker)
        answer: dict[str, Any] = await self._request("PUT", f"/v1/models/{model}/traffic", json=body)
        return answer

    async def clear_traffic(self, model: str) -> None:
        """Remove the model's traffic policy (operator): every job goes to its served version again."""
        await self._request("DELETE", f"/v1/models/{model}/traffic")

    async def comparisons(self, model: str, limit: int = 50) -> list[dict[str, Any]]:
        """The model's recent shadow comparisons, newest first (operator)."""
        answer = await self._request("GET", f"/v1/models/{model}/comparisons", params={"limit": limit})
        return list(answer)

    async def usage(
        self,
        group_by: str | Sequence[str] = ("model",),
        *,
        since: str | float | None = None,
        until: str | float | None = None,
    ) -> UsageReport:
        """Jobs, items, device-seconds and cost (``GET /v1/usage``), grouped by any of ``tenant``, ``model``,
        ``version`` and ``device``, between ``since`` and ``until`` (unix seconds, ISO 8601 or a time ago such as
        ``"24h"``; default: the last 24 hours), widened to whole hours. A tenant's key sees its own tenant's usage
        only; the operator token every tenant's. Raises InvalidInput or GatewayError (422) naming a bad argument."""
        fields = group_by if isinstance(group_by, str) else ",".join(group_by)
        params = {"group_by": fields}
        if since is not None:
            params["from"] = str(since)
        if until is not None:
            params["to"] = str(until)
        return UsageReport.model_validate(await self._request("GET", "/v1/usage", params=params))

    async def subscribe(self, job_ids: Iterable[str], *, timeout_s: float | None = None) -> AsyncIterator[JobRecord]:
        """Yield each job's terminal record once, in the order they end, over one WebSocket (``/v1/ws``).

        An outage of the gateway's store only delays the records: the gateway waits it out for each watched job.

        Args:
            job_ids: the jobs to watch; duplicates are watched once.
            timeout_s: give up after this many seconds in total (None: wait as long as it takes).

        Raises:
            JobNotFound: one of the ids is unknown (records already yielded stay valid).
            TimeoutError: ``timeout_s`` passed before every job ended.
            GatewayError: the gateway refused the subscription (too many ids: see ``GatewayLimits``).
        """
        pending = set(dict.fromkeys(job_ids))
        if not pending:
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        url = ws_url(self.base_url, "/v1/ws")
        try:
            async with ws_connect(url, open_timeout=self.timeout_s, additional_headers=self._auth) as websocket:
                ids = sorted(pending)
                for start in range(0, len(ids), SUBSCRIBE_IDS_PER_FRAME):
                    await websocket.send(json.dumps({"subscribe": ids[start : start + SUBSCRIBE_IDS_PER_FRAME]}))
                while pending:
                    remaining_s = None if deadline is None else max(0.0, deadline - time.monotonic())
                    try:
                        async with asyncio.timeout(remaining_s):
                            frame = json.loads(await websocket.recv())
                    except TimeoutError:
                        raise TimeoutError(f"{len(pending)} job(s) not ended after {timeout_s:g}s") from None
                    record = self._frame_record(frame)
                    if record is not None and record.job_id in pending:
                        pending.discard(record.job_id)
                        yield record
        except TimeoutError:
            raise  # ours, above; TimeoutError is an OSError
        except (OSError, ConnectionClosed) as exc:
            raise GatewayUnreachable(f"websocket {url}: {exc}") from exc

    # -- DAGs -----------------------------------------------------------------------------------------------------
    async def register_dag(self, spec: str | Mapping[str, Any]) -> tuple[str, int]:
        """Register a DAG spec (YAML or JSON text, or a mapping) and return ``(name, version)``; the same spec again
        keeps its version.

        Raises:
            DagInvalid: the spec does not parse or is wrong; ``exc.problems`` names each step and path.
        """
        if isinstance(spec, str):
            answer = await self._request("POST", "/v1/dags", content=spec, headers={"content-type": "application/yaml"})
        else:
            answer = await self._request("POST", "/v1/dags", json=dict(spec))
        return str(answer["name"]), int(answer["version"])

    async def get_dag(self, name: str, version: int | None = None) -> dict[str, Any]:
        """A registered DAG: ``{name, version, versions, spec, graph: {nodes, edges}, mermaid}``. Raises UnknownDag."""
        params = {"version": version} if version is not None else None
        shown: dict[str, Any] = await self._request("GET", f"/v1/dags/{name}", params=params)
        return shown

    async def start_run(
        self,
        name: str,
        input: Any,
        *,
        run_id: str | None = None,
        timeout_s: float | None = None,
        version: int | None = None,
    ) -> str:
        """Start a run of the DAG's latest version (or of ``version``) and return its id.

        Args:
            run_id: an idempotency key of the key's tenant: starting the same id again starts nothing and returns
                it.
            timeout_s: a run not over within this many seconds ends ``expired``.
            version: the DAG version to run (default: the latest); ``get_run`` names the version a run runs.

        Raises:
            UnknownDag: no such DAG. InvalidInput: ``input`` fails its input schema, or a bad ``run_id``.
        """
        body: dict[str, Any] = {"input": input}
        if run_id is not None:
            body["run_id"] = run_id
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if version is not None:
            body["version"] = version
        answer = await self._request("POST", f"/v1/dags/{name}/runs", json=body)
        return str(answer["run_id"])

    async def get_run(self, run_id: str) -> dict[str, Any]:
        """The run: ``{run_id, dag, version, state, steps: {<id>: {state, job_ids, items, started_at, finished_at,
        error}}, output, error, created_at, finished_at}``. Raises UnknownRun."""
        view: dict[str, Any] = await self._request("GET", f"/v1/runs/{run_id}")
        return view

    async def wait_run(self, run_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Long-poll until the run is over (``succeeded``, ``failed``, ``cancelled`` or ``expired``) and return it;
        retriable failures are retried with backoff, as in ``wait``.

        Raises:
            TimeoutError: the run is still running after ``timeout_s``. UnknownRun: no such run.
        """
        view: dict[str, Any] = await self._patiently(
            lambda remaining_s: self._poll_run(run_id, remaining_s),
            lambda view: view["state"] != "running",
            timeout_s,
            lambda _: f"DAG run {run_id!r} is still running after {timeout_s:g}s",
        )
        return view

    async def _poll_run(self, run_id: str, remaining_s: float) -> dict[str, Any]:
        step_s = min(self.long_poll_s, remaining_s)
        if step_s <= 0.001:
            return await self.get_run(run_id)
        view: dict[str, Any] = await self._request(
            "GET", f"/v1/runs/{run_id}", params={"wait": f"{step_s:.3f}"}, timeout_s=step_s + self.timeout_s
        )
        return view

    async def cancel_run(self, run_id: str) -> dict[str, Any]:
        """Cancel a running run and return it. Raises UnknownRun, or GatewayError (409) when it already ended."""
        view: dict[str, Any] = await self._request("POST", f"/v1/runs/{run_id}/cancel")
        return view

    async def run_events(self, run_id: str) -> AsyncIterator[dict[str, Any]]:
        """Yield the run's events over its WebSocket (``/v1/runs/{id}/ws``): ``{"type": "run", "run"}`` first,
        ``{"type": "step", "step", "state", "run"}`` as steps change, ``{"type": "result", "run"}`` last.

        Raises:
            UnknownRun: no such run. GatewayUnreachable: the socket could not be opened or broke.
        """
        url = ws_url(self.base_url, f"/v1/runs/{run_id}/ws")
        try:
            async with ws_connect(url, open_timeout=self.timeout_s, additional_headers=self._auth) as websocket:
                async for text in websocket:
                    event = json.loads(text)
                    if event.get("type") == "error":
                        error = event.get("error") or {}
                        raise error_from_response(404 if error.get("type") == "run_not_found" else 500, event)
                    yield event
                    if event.get("type") == "result":
                        return
        except (OSError, ConnectionClosed) as exc:
            raise GatewayUnreachable(f"websocket {url}: {exc}") from exc
        raise GatewayUnreachable(f"websocket {url} closed before the run's result")

    def _frame_record(self, frame: dict[str, Any]) -> JobRecord | None:
        if frame.get("type") == "result":
            return self._record(frame["job"])
        if frame.get("type") == "error":
            error = frame.get("error") or {}
            raise error_from_response(404 if error.get("type") == "job_not_found" else 400, {"error": error})
        return None
