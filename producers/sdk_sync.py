"""The synchronous Python client of the Fleet gateway, for scripts, notebooks and threaded servers.

Example::

    with FleetSyncClient("http://127.0.0.1:8000") as fleet:
        vector = fleet.infer("embed", {"text": "hello"})["embedding"]  # one request: POST /v1/infer
        job_id = fleet.submit("embed", {"text": "later"}, encoding_format="base64")  # compact; floats come back
        record = fleet.wait(job_id, timeout_s=30)
        for record in fleet.subscribe([id1, id2]):
            ...

Each method is ``FleetClient``'s of the same name (same arguments, same exceptions: see ``fleet.producers.sdk``), run on
an event loop of the client's own in a background thread (an ``anyio`` blocking portal), so it also works where an
event loop is already running, and one client may be shared by threads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

from anyio.from_thread import start_blocking_portal

from fleet.producers.sdk import FleetClient
from fleet.schemas.api import BatchResponse, JobPage, JobSummary
from fleet.schemas.jobs import JobRecord
from fleet.schemas.usage import UsageReport

__all__ = ["FleetSyncClient"]

T = TypeVar("T")


class FleetSyncClient:
    """Blocking client of one Fleet gateway; use it as ``with FleetSyncClient(url) as fleet`` (or call ``close``).

    Args:
        base_url: the gateway, e.g. ``http://127.0.0.1:8000``.
        **options: ``FleetClient``'s keyword options (``timeout_s``, ``long_poll_s``, ``api_key``,
            ``decode_vectors``, ``vector_fields``).
    """

    def __init__(self, base_url: str, **options: Any) -> None:
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._client = FleetClient(base_url, **options)
        self._closed = False

    def __enter__(self) -> FleetSyncClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the HTTP connections and stop the background loop; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self._client.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("this FleetSyncClient is closed")
        return self._portal.call(partial(method, *args, **kwargs))

    def _iterate(self, stream: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._call(stream.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None and not self._closed:
                self._call(aclose)

    # -- jobs -----------------------------------------------------------------------------------------------------
    def submit(self, model: str, input: dict[str, Any], **options: Any) -> str:
        """Submit one job and return its id (``FleetClient.submit``)."""
        job_id: str = self._call(self._client.submit, model, input, **options)
        return job_id

    def submit_many(self, jobs: Iterable[Mapping[str, Any]]) -> BatchResponse:
        """Submit many jobs, one answer each, in order (``FleetClient.submit_many``)."""
        answer: BatchResponse = self._call(self._client.submit_many, list(jobs))
        return answer

    def list_jobs(self, **filters: Any) -> JobPage:
        """One page of the job history, newest first (``FleetClient.list_jobs``: model, state, tenant, since,
        until, cursor, limit)."""
        page: JobPage = self._call(self._client.list_jobs, **filters)
        return page

    def iter_jobs(self, **filters: Any) -> Iterator[JobSummary]:
        """Every matching job, newest first, page after page (``FleetClient.iter_jobs``)."""
        return self._iterate(self._client.iter_jobs(**filters))

    def infer(self, model: str, input: dict[str, Any], **options: Any) -> Any:
        """Run one job in one request and return its output (``FleetClient.infer``)."""
        return self._call(self._client.infer, model, input, **options)

    def get(self, job_id: str) -> JobRecord:
        """The job's current record (``FleetClient.get``)."""
        record: JobRecord = self._call(self._client.get, job_id)
        return record

    def wait(self, job_id: str, timeout_s: float = 60.0) -> JobRecord:
        """Block until the job is terminal and return its record (``FleetClient.wait``)."""
        record: JobRecord = self._call(self._client.wait, job_id, timeout_s)
        return record

    def result(self, job_id: str, *, timeout_s: float = 60.0) -> Any:
        """Wait for the job and return its output (``FleetClient.result``)."""
        return self._call(self._client.result, job_id, timeout_s=timeout_s)

    def run(self, model: str, input: dict[str, Any], **options: Any) -> Any:
        """``submit`` then ``result`` (``FleetClient.run``)."""
        return self._call(self._client.run, model, input, **options)

    def cancel(self, job_id: str) -> JobRecord:
        """Cancel a queued or running job (``FleetClient.cancel``)."""
        record: JobRecord = self._call(self._client.cancel, job_id)
        return record

    def models(self) -> list[dict[str, Any]]:
        """The served models (``FleetClient.models``)."""
        models: list[dict[str, Any]] = self._call(self._client.models)
        return models

    def subscribe(self, job_ids: Iterable[str], *, timeout_s: float | None = None) -> Iterator[JobRecord]:
        """Yield each job's terminal record once, in the order they end (``FleetClient.subscribe``)."""
        return self._iterate(self._client.subscribe(list(job_ids), timeout_s=timeout_s))

    def usage(
        self,
        group_by: str | Sequence[str] = ("model",),
        *,
        since: str | float | None = None,
        until: str | float | None = None,
    ) -> UsageReport:
        """Usage and cost grouped as asked (``FleetClient.usage``)."""
        report: UsageReport = self._call(self._client.usage, group_by, since=since, until=until)
        return report

    # -- DAGs -----------------------------------------------------------------------------------------------------
    def register_dag(self, spec: str | Mapping[str, Any]) -> tuple[str, int]:
        """Register a DAG spec and return ``(name, version)`` (``FleetClient.register_dag``)."""
        registered: tuple[str, int] = self._call(self._client.register_dag, spec)
        return registered

    def get_dag(self, name: str, version: int | None = None) -> dict[str, Any]:
        """A registered DAG (``FleetClient.get_dag``)."""
        shown: dict[str, Any] = self._call(self._client.get_dag, name, version)
        return shown

    def start_run(self, name: str, input: Any, **options: Any) -> str:
        """Start a run and return its id (``FleetClient.start_run``)."""
        run_id: str = self._call(self._client.start_run, name, input, **options)
        return run_id

    def get_run(self, run_id: str) -> dict[str, Any]:
        """The run (``FleetClient.get_run``)."""
        view: dict[str, Any] = self._call(self._client.get_run, run_id)
        return view

    def wait_run(self, run_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Block until the run is over and return it (``FleetClient.wait_run``)."""
        view: dict[str, Any] = self._call(self._client.wait_run, run_id, timeout_s)
        return view

    def cancel_run(self, run_id: str) -> dict[str, Any]:
        """Cancel a running run (``FleetClient.cancel_run``)."""
        view: dict[str, Any] = self._call(self._client.cancel_run, run_id)
        return view

    def run_events(self, run_id: str) -> Iterator[dict[str, Any]]:
        """Yield the run's events as they happen (``FleetClient.run_events``)."""
        return self._iterate(self._client.run_events(run_id))
