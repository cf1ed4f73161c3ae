"""Per-tenant rate limits and queued-job quotas at the gateway: the submit hooks, the 429s and the headers.

Which requests count (``FLEET_RATE_LIMIT`` and friends, ``fleet.store.quotas``; all off by default):

* ``POST /v1/jobs`` and ``POST /v1/infer``: the rate and the quota, in one Redis script per submit, run once the
  body is known to be a valid job (a 400/404/413/422 costs nothing). For a model with result caches it runs
  before the lookup (``charge``: a cache hit is a submit, it counts against the rate, not the quota, since
  nothing is queued); otherwise after the model's queue bound (a ``queue_full`` refusal costs nothing) and
  together with the job's creation (``charge_and_create``: on one Redis a single script, ``ADMIT_CREATE_LUA``, so
  limits cost the submit no extra round trip). The tenant is the API key's (``FLEET_AUTH=off``: ``default``).
  ``settled`` gives the place back when the submit did not leave a new queued job (a cache hit, a resubmit of an
  existing id, a refusal or failure further on).
* ``POST /v1/dags/{name}/runs``: the rate only (``limit_rate``, a route dependency); a run's steps are not
  counted against the quota.
* Reads (polls, long-polls, WebSockets, SSE) and operator routes are not limited.

A refusal is ``429`` with ``Retry-After`` (whole seconds) and the error body: ``rate_limited`` (details: tenant,
rate, burst, retry_after_s) or ``quota_exceeded`` (details: tenant, max_queued, queued). Every answer of a
counted route carries the IETF draft headers ``RateLimit-Limit`` (the burst), ``RateLimit-Remaining``,
``RateLimit-Reset`` (seconds until the burst is whole again) and ``RateLimit-Policy`` (``burst;w=window``), added
by ``RateLimitHeaders`` from the decision left in the request's state. Refusals are counted in
``fleet_rate_limited_total{tenant,reason}``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet import constants as c
from fleet.limit_policy import LimitPolicy
from fleet.producers.gateway.access.auth import authenticator
from fleet.producers.gateway.access.principals import SUBMITTER
from fleet.producers.gateway.calls import Bounded
from fleet.producers.gateway.errors import ApiError
from fleet.schemas.api import SubmitResponse
from fleet.schemas.jobs import JobRecord, JobState
from fleet.store.base import ResultStore
from fleet.store.quotas import QUOTA_EXCEEDED, Decision, Quotas, hold_s

log = logging.getLogger(__name__)

STATE_KEY = "fleet_rate_limit"  # the decision of this request, in the ASGI scope's state
HOLD_KEY = "fleet_quota_hold"  # (tenant, job id) of a place this submit took

RATE_LIMITED = Counter(
    "fleet_rate_limited_total",
    "Requests refused with 429 by a tenant's limits, by tenant and reason: rate_limited or quota_exceeded.",
    ["tenant", "reason"],
)
ADMITTED = Counter("fleet_rate_admitted_total", "Requests admitted by a tenant's limits, by tenant.", ["tenant"])
_ADMITTED_OF: dict[str, Any] = {}  # tenant -> its child of ADMITTED (``labels`` takes a lock on each call)
SWEPT = Counter(
    "fleet_quota_swept_total",
    "Queued-job places freed by a sweep (the job had ended, but no release reached the quota), by tenant.",
    ["tenant"],
)


@dataclass(slots=True)
class TenantLimiter:
    """The limits of one gateway: the policy, where they are kept, and the result store a sweep re-reads."""

    policy: LimitPolicy
    quotas: Quotas
    store: ResultStore
    job_ttl_s: float
    _swept_at: dict[str, float] = field(default_factory=dict)

    async def charge(self, tenant: str, job: JobRecord | None) -> Decision | None:
        """Decide one request of ``tenant`` (with ``job``: also take a place in its quota); None when nothing
        limits it (no round trip then)."""
        limit = self.policy.for_tenant(tenant)
        if limit.rate is None and (job is None or limit.max_queued == 0):
            return None
        if job is None or limit.max_queued == 0:
            return await self.quotas.decide(tenant, limit, None, 0.0)
        hold = hold_s(job.expires_at, time.time(), self.job_ttl_s)
        decision = await self.quotas.decide(tenant, limit, job.job_id, hold)
        if decision.verdict == QUOTA_EXCEEDED and await self._sweep(tenant):
            decision = await self.quotas.decide(tenant, limit, job.job_id, hold)
        return decision

    async def charge_and_create(self, tenant: str, job: JobRecord, message: bytes) -> tuple[Decision | None, bool]:
        """``charge(tenant, job)`` and, only when it admits, ``store.create(job, message)``: one round trip on one
        Redis. Returns (the decision, None when nothing limits the tenant; whether the record was created)."""
        limit = self.policy.for_tenant(tenant)
        if not limit.enabled:
            return None, await self.store.create(job, message)
        hold = hold_s(job.expires_at, time.time(), self.job_ttl_s) if limit.max_queued else 0.0
        decision, created = await self.quotas.decide_and_create(self.store, tenant, limit, hold, job, message)
        if decision.verdict == QUOTA_EXCEEDED and await self._sweep(tenant):
            decision, created = await self.quotas.decide_and_create(self.store, tenant, limit, hold, job, message)
        return decision, created

    async def _sweep(self, tenant: str) -> bool:
        """Free the places of the tenant's oldest jobs whose records are terminal or gone; True if any was."""
        now = time.monotonic()
        if now - self._swept_at.get(tenant, -math.inf) < c.QUOTA_SWEEP_INTERVAL_S:
            return False
        self._swept_at[tenant] = now
        ids = await self.quotas.members(tenant, c.QUOTA_SWEEP_MAX_IDS)
        records = await self.store.get_many(ids)
        ended = [i for i, record in zip(ids, records, strict=True) if record is None or record.terminal]
        await self.quotas.forget(tenant, ended)
        if ended:
            SWEPT.labels(tenant).inc(len(ended))
            log.info("tenant %s at its queued-job bound: %d ended jobs freed their places", tenant, len(ended))
        return bool(ended)


def limiter_of(request: Request) -> TenantLimiter | None:
    """This gateway's limits (``GatewayState.tenant_limiter``: None without any), read without importing the state,
    which holds this module's type."""
    limiter: TenantLimiter | None = request.app.state.gateway.tenant_limiter
    return limiter


async def tenant_of(request: Request) -> str:
    """The tenant of the caller (the route's own dependency authenticated it already; a repeat is a cache hit)."""
    principal = await authenticator(request).authenticate(request.headers.get("authorization"), SUBMITTER)
    return principal.tenant or c.DEFAULT_TENANT


def refusal(tenant: str, decision: Decision) -> ApiError:
    """The 429 for a refused decision."""
    limit, retry_s = decision.limit, max(1, math.ceil(decision.retry_after_s))
    headers = {"Retry-After": str(retry_s)}
    if decision.verdict == QUOTA_EXCEEDED:
        RATE_LIMITED.labels(tenant, "quota_exceeded").inc()
        return ApiError(
            429,
            "quota_exceeded",
            f"tenant {tenant!r} has {decision.queued} jobs queued or running, its bound is {limit.max_queued}; "
            "retry once some have finished",
            {"tenant": tenant, "max_queued": limit.max_queued, "queued": decision.queued, "retry_after_s": retry_s},
            headers=headers,
        )
    RATE_LIMITED.labels(tenant, "rate_limited").inc()
    return ApiError(
        429,
        "rate_limited",
        f"tenant {tenant!r} is over its rate limit ({limit.rate:g}/s, bursts of {limit.burst}); retry in {retry_s}s",
        {"tenant": tenant, "rate": limit.rate, "burst": limit.burst, "retry_after_s": decision.retry_after_s},
        headers=headers,
    )


def _note(request: Request, tenant: str, decision: Decision | None, job: JobRecord | None) -> None:
    """Leave ``decision`` for the headers and the give-back; raise the 429 when it refused."""
    if decision is None:
        return
    request.scope.setdefault("state", {})[STATE_KEY] = decision
    if not decision.admitted:
        raise refusal(tenant, decision)
    admitted = _ADMITTED_OF.get(tenant)
    if admitted is None:
        admitted = _ADMITTED_OF[tenant] = ADMITTED.labels(tenant)
    admitted.inc()
    if decision.added and job is not None:
        request.scope["state"][HOLD_KEY] = (tenant, job.job_id)


async def _decide(request: Request, job: JobRecord | None) -> None:
    limiter = limiter_of(request)
    if limiter is None:
        return
    tenant = await tenant_of(request)
    _note(request, tenant, await limiter.charge(tenant, job), job)


async def charge(request: Request, job: JobRecord) -> None:
    """Count a submit of ``job`` against its tenant's rate and quota; raises ``ApiError`` 429 when refused."""
    await _decide(request, job)


async def charge_and_create(request: Request, job: JobRecord, message: bytes, bounded: Bounded) -> bool:
    """``charge`` and, when it admits, ``store.create(job, message)`` (in one Redis round trip where the store and
    the limits share one Redis); True if the record was created. Raises 429 as ``charge``, ``StoreError`` as
    ``bounded`` (the result store's calls, bounded by their timeout)."""
    limiter = limiter_of(request)
    assert limiter is not None, "charge_and_create is for a gateway with limits"
    tenant = await tenant_of(request)
    decision, created = await bounded(limiter.charge_and_create(tenant, job, message))
    _note(request, tenant, decision, job)
    return created


async def limit_rate(request: Request) -> None:
    """FastAPI dependency of a route counted against the rate only (``POST /v1/dags/{name}/runs``)."""
    await _decide(request, None)


async def settled(request: Request, submit: Awaitable[SubmitResponse]) -> SubmitResponse:
    """Await a submit; give its quota place back unless it left a new queued job (see the module docstring)."""
    try:
        answer = await submit
    except BaseException:
        await asyncio.shield(_give_back(request))
        raise
    if answer.status != JobState.queued:
        await _give_back(request)
    return answer


async def _give_back(request: Request) -> None:
    hold = request.scope.get("state", {}).pop(HOLD_KEY, None)
    limiter = limiter_of(request)
    if hold is None or limiter is None:
        return
    try:
        await limiter.quotas.release([hold])
    except Exception as exc:  # the place frees itself: the sweep finds no queued record, or the hold ends
        log.warning("tenant %s: could not give back the place of job %s: %s", hold[0], hold[1], exc)


def rate_headers(decision: Decision) -> list[tuple[bytes, bytes]]:
    """The ``RateLimit-*`` headers of a decision with a rate (none for a quota-only limit)."""
    limit = decision.limit
    if limit.rate is None:
        return []
    values = {
        "ratelimit-limit": str(limit.burst),
        "ratelimit-remaining": str(max(0, decision.remaining)),
        "ratelimit-reset": str(math.ceil(decision.reset_s)),
        "ratelimit-policy": f"{limit.burst};w={limit.window_s}",
    }
    return [(name.encode(), value.encode()) for name, value in values.items()]


class RateLimitHeaders:
    """Pure ASGI middleware: adds the ``RateLimit-*`` headers to the answer of a request a limit decided."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                decision = scope.get("state", {}).get(STATE_KEY)
                if decision is not None:
                    message["headers"] = [*message.get("headers", []), *rate_headers(decision)]
            await send(message)

        await self.app(scope, receive, send_wrapper)


def build_limiter(policy: LimitPolicy, quotas: Quotas, store: ResultStore, job_ttl_s: float) -> TenantLimiter | None:
    """The gateway's limiter, or None when the policy limits nothing (every hook is then a no-op)."""
    return TenantLimiter(policy, quotas, store, job_ttl_s) if policy.enabled else None
