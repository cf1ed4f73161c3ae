"""Fleet's exceptions. Errors are data: each carries the fields a caller needs and a ``retriable`` flag.

FleetError
 +-- ConfigError                 bad settings or flags; raised at start-up
 +-- UnknownModel(model, known)  a model name or import path that resolves to nothing
 |    +-- UnservedVersion(model, version, served)  name@version where another version of the model is served
 +-- InvalidInput(errors)        input that does not match a model's schema
 +-- DagInvalid(problems)        a DAG spec refused at registration: each problem names its step and path
 +-- PayloadTooLarge(size, limit)
 +-- BrokerError                 retriable: the broker is unreachable or did not acknowledge
 |    +-- BrokerUnavailable
 |    +-- PublishFailed
 |         +-- QueueFull(model, limit)  the model's queue holds its bound: the gateway or the broker refused
 +-- StoreError                  retriable: the result store is unreachable
 +-- JobNotFound(job_id)
 +-- UnknownDag(name, version)   no such DAG (or version) is registered
 +-- UnknownRun(run_id)          no such DAG run (never started, or its record expired)
 +-- ModelError(message)         the model raised while computing; retriable unless it says otherwise
 +-- ModelUnavailable(model, version, cause)  a worker's model pool could not load that version (a failed load,
                                 a model larger than the budget): its jobs fail at once, not retried
 +-- ServiceUnavailable(service, hint)  a test or start-up dependency that is not running
 +-- ScalerError(backend, target)  a scaler backend could not read or set replicas; retriable unless it says otherwise
 +-- StartupTimeout(what, attempts, waited_s)  a broker or store still unreachable at the start-up deadline
 +-- LinkRefused(service, target, what, reason, hint)  NATS, Kafka or Redis refused the credentials or the TLS
                                 handshake failed: not retriable (fleet.links)
"""

from __future__ import annotations

from typing import Any


class FleetError(Exception):
    retriable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(FleetError):
    pass


class UnknownModel(FleetError):
    def __init__(self, model: str, known: list[str] | None = None) -> None:
        hint = f"; known models: {', '.join(sorted(known))}" if known else ""
        super().__init__(f"unknown model {model!r}{hint}")
        self.model = model
        self.known = known or []


class UnservedVersion(UnknownModel):
    """``name@version`` names a version of a served model other than the one served (the gateway's 404)."""

    def __init__(self, model: str, version: str, served: str) -> None:
        super().__init__(model, [model])
        self.message = f"model {model!r} is served at version {served!r} here, not {version!r}"
        self.args = (self.message,)
        self.version = version
        self.served = served


class InvalidInput(FleetError):
    def __init__(self, message: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []


class DagInvalid(FleetError):
    """Every problem found in a DAG spec, each ``{"step", "path", "message"}`` (``step`` is None for the spec's own
    fields); the message lists them all, e.g. ``step 'collect': input.n: unknown step 'embed_eachh'``."""

    def __init__(self, problems: list[dict[str, Any]]) -> None:
        lines = [self.line(p) for p in problems]
        head = "the DAG spec is invalid" if len(lines) == 1 else f"the DAG spec has {len(lines)} problems"
        super().__init__(f"{head}: " + "; ".join(lines))
        self.problems = problems

    @staticmethod
    def line(problem: dict[str, Any]) -> str:
        where = [f"step {problem['step']!r}"] if problem.get("step") else []
        where += [problem["path"]] if problem.get("path") else []
        return ": ".join([*where, problem["message"]])


class PayloadTooLarge(FleetError):
    def __init__(self, size: int, limit: int, what: str = "body") -> None:
        super().__init__(f"{what} is {size} bytes, over the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class BrokerError(FleetError):
    retriable = True


class BrokerUnavailable(BrokerError):
    pass


class PublishFailed(BrokerError):
    pass


class QueueFull(PublishFailed):
    """A model's queue holds ``limit`` requests (waiting or in flight): the gateway (429) or the broker refused one.

    ``depth`` is how many the queue was seen to hold, ``retry_after_s`` when it should have room again; either may be
    unknown (None), e.g. when the broker refused a direct publish.
    """

    def __init__(
        self, model: str, limit: int | None, *, depth: int | None = None, retry_after_s: float | None = None
    ) -> None:
        held = f"{depth} requests waiting or in flight" if depth is not None else ""
        why = ", ".join(f for f in (held, f"bound {limit}" if limit else "") if f) or "the broker refused the request"
        super().__init__(f"the queue of model {model!r} is full ({why}); retry later")
        self.model = model
        self.limit = limit
        self.depth = depth
        self.retry_after_s = retry_after_s


class StoreError(FleetError):
    retriable = True


class JobNotFound(FleetError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job with id {job_id!r} (it may never have existed or its record expired)")
        self.job_id = job_id


class UnknownDag(FleetError):
    def __init__(self, name: str, version: int | None = None) -> None:
        which = f"{name!r} version {version}" if version is not None else repr(name)
        super().__init__(f"no DAG {which} is registered (POST /v1/dags registers one)")
        self.name = name


class UnknownRun(FleetError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"no DAG run {run_id!r} (it may never have existed or its record expired)")
        self.run_id = run_id


class RunIdTaken(FleetError):
    """A run id that belongs to another tenant's run: the start must neither reveal nor touch that run."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run id {run_id!r} cannot be used; choose another run_id (or let Fleet choose)")
        self.run_id = run_id


class ModelError(FleetError):
    retriable = True

    def __init__(self, message: str, *, retriable: bool = True) -> None:
        super().__init__(message)
        self.retriable = retriable


class ModelUnavailable(FleetError):
    """A worker's model pool cannot serve ``model`` at ``version`` now: its load failed (``cause``), or it alone is
    larger than the worker's memory budget. Not retriable: the jobs that needed it fail with this message."""

    def __init__(self, model: str, version: str, cause: str, retry_in_s: float | None = None) -> None:
        again = f"; the worker tries to load it again in {retry_in_s:.0f} s" if retry_in_s else ""
        super().__init__(f"model {model!r} version {version!r} cannot be loaded: {cause}{again}")
        self.model = model
        self.version = version
        self.cause = cause


class ServiceUnavailable(FleetError):
    def __init__(self, service: str, hint: str) -> None:
        super().__init__(f"{service} is not available: {hint}")
        self.service = service
        self.hint = hint


class ScalerError(FleetError):
    """A scaler backend could not read or change a model's replicas (e.g. a Deployment that is missing or forbidden)."""

    retriable = True

    def __init__(self, message: str, *, backend: str, target: str, retriable: bool = True) -> None:
        super().__init__(message)
        self.backend = backend
        self.target = target
        self.retriable = retriable


class StartupTimeout(FleetError):
    """A start-up step (connect, create a group, ...) kept failing with retriable errors until the deadline."""

    def __init__(self, what: str, attempts: int, waited_s: float, last: FleetError) -> None:
        super().__init__(
            f"could not {what} within {waited_s:.0f}s ({attempts} attempts): {last.message} "
            "(FLEET_STARTUP_TIMEOUT_S sets how long start-up retries)"
        )
        self.what = what
        self.attempts = attempts
        self.waited_s = waited_s
        self.last = last


class LinkRefused(FleetError):
    """A broker or store answered but refused the link: wrong credentials, or a TLS handshake that failed (an
    untrusted CA, a wrong host name). Retrying cannot help, so start-up fails at once with this message."""

    def __init__(self, service: str, target: str, what: str, reason: str, hint: str) -> None:
        super().__init__(f"{service} at {target}: {what} ({reason}); {hint}")
        self.service = service
        self.target = target
        self.what = what
        self.reason = reason
        self.hint = hint
