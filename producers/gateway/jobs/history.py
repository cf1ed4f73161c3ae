"""``GET /v1/jobs``: the job history, newest first, from the store's job index (``fleet.store.jobindex``).

1. Who sees what. A caller lists its own tenant's jobs. ``?tenant=`` naming another tenant answers ``403
   forbidden`` (never an empty page that could pass for "no jobs"), except for the operator token and an operator
   key of the default tenant, which list any tenant's, and without ``?tenant=`` every tenant's (the all-tenant
   index). Shadow copies of a traffic policy are listed to those alone, as ``GET /v1/jobs/{id}`` reads them.
2. Which index. ``?model=`` reads the tenant's per-model index, else the tenant's own; ``?since=`` / ``?until=``
   (unix seconds or RFC 3339) bound the scores. Each page reads the records of the entries it meets (one MGET per
   chunk): a record that is gone (expired, or deleted after a failed publish) is skipped and its entry removed
   (the lazy half of retention); a record of another tenant than the index's is never shown (a belt to the
   index's braces).
3. ``?state=`` (one or more, comma-separated) filters on those records, so a page may need to read many entries
   to fill: it reads at most ``JOB_LIST_SCAN_MAX`` and then answers what it found with a cursor where it stopped
   (``scanned`` says how many it read), so a request costs milliseconds whatever the history holds.
4. The cursor is where the page stopped (the last entry's score and job id) and a digest of the listing it
   belongs to (scope and filters), in URL-safe base64 JSON with a checksum: a cursor that does not decode, was
   altered, or comes from another listing (another tenant's, other filters) answers ``400 invalid_cursor``.
   It is not secret (it names one of the caller's own jobs) and gives nothing: the scope is always the caller's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from dataclasses import dataclass
from datetime import datetime

from fastapi import APIRouter, Depends, Query

from fleet import constants as c
from fleet import tenancy
from fleet.limit_policy import TENANT_RE
from fleet.producers.gateway.access import AUTH_RESPONSES, OPERATOR, SUBMITTER_DEPS, Principal, require_submitter
from fleet.producers.gateway.errors import ApiError, error_responses
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.schemas.api import JobPage, JobSummary
from fleet.schemas.jobs import JobRecord, JobState
from fleet.store.jobindex import Position, Scope

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=SUBMITTER_DEPS, responses=AUTH_RESPONSES)

MAX_CURSOR_CHARS = 600
MAX_TIME_S = 1e11  # about year 5138: beyond is a typo, not a time
CHUNK_MIN = 50  # entries one read asks for at least (a state filter skips some)


@dataclass(frozen=True, slots=True)
class Listing:
    """A listing request once checked: where to read (``scope``), what to keep, from where."""

    scope: Scope
    states: frozenset[JobState] | None
    since: float | None
    until: float | None
    limit: int
    privileged: bool  # the operator token or a default-tenant operator key: shadow copies are shown

    def digest(self) -> str:
        """What a cursor must have been made for: the scope and every filter."""
        states = ",".join(sorted(self.states)) if self.states else ""
        text = f"{self.scope.tenant}|{self.scope.model}|{states}|{self.since!r}|{self.until!r}|{self.privileged}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _bad(field: str, message: str, type_: str = "invalid_request", status: int = 422) -> ApiError:
    error = {"loc": f"query.{field}", "msg": message, "type": "value_error"}
    return ApiError(status, type_, f"invalid request: query.{field}: {message}", [error])


# -- the pure parts: times, states, cursors ----------------------------------------------------------------------
def parse_time(field: str, value: str | None) -> float | None:
    """Unix seconds from ``value`` (a number, or an RFC 3339 time with its offset); None for None."""
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            moment = datetime.fromisoformat(text.replace("z", "Z"))
        except ValueError:
            raise _bad(field, f"expected unix seconds or an RFC 3339 time, got {value[:64]!r}") from None
        if moment.tzinfo is None:
            raise _bad(field, f"an RFC 3339 time needs its offset (Z or +hh:mm), got {value[:64]!r}") from None
        seconds = moment.timestamp()
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_TIME_S:
        raise _bad(field, f"must be a time between 0 and {MAX_TIME_S:.0f} unix seconds, got {value[:64]!r}")
    return seconds


def parse_states(value: str | None) -> frozenset[JobState] | None:
    if value is None or not value.strip():
        return None
    states = set()
    for name in value.split(","):
        try:
            states.add(JobState(name.strip()))
        except ValueError:
            valid = ", ".join(s.value for s in JobState)
            message = f"unknown state {name.strip()[:32]!r}; one or more (comma-separated) of {valid}"
            raise _bad("state", message) from None
    return frozenset(states)


def _checksum(body: str) -> str:
    return hashlib.sha256(b"fleet-job-cursor:" + body.encode()).hexdigest()[:12]


def encode_cursor(position: Position, query: Listing) -> str:
    body = json.dumps({"s": position.score, "j": position.job_id, "q": query.digest()}, separators=(",", ":"))
    raw = json.dumps({"b": body, "c": _checksum(body)}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _bad_cursor(message: str) -> ApiError:
    return _bad("cursor", message, "invalid_cursor", 400)


def decode_cursor(cursor: str, query: Listing) -> Position:
    """The position ``cursor`` names. Raises 400 ``invalid_cursor`` for anything but a cursor this listing made."""
    unknown = "not a cursor of this listing: pass next_cursor as it came, with the same filters"
    if len(cursor) > MAX_CURSOR_CHARS:
        raise _bad_cursor(unknown)
    try:
        outer = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        body = outer["b"]
        if not isinstance(body, str) or outer.get("c") != _checksum(body):
            raise _bad_cursor(unknown)
        inner = json.loads(body)
        score, job_id, made_for = float(inner["s"]), inner["j"], inner["q"]
    except (binascii.Error, ValueError, TypeError, KeyError, UnicodeDecodeError):
        raise _bad_cursor(unknown) from None
    if made_for != query.digest():
        raise _bad_cursor("the cursor belongs to another listing (other filters, or another tenant's)")
    if not isinstance(job_id, str) or not math.isfinite(score):
        raise _bad_cursor(unknown)
    return Position(score, job_id)


def summary(record: JobRecord) -> JobSummary:
    return JobSummary(
        job_id=record.job_id,
        model=record.model,
        state=record.state,
        tenant=tenancy.owner(record.tenant),
        version=record.version,
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        expires_at=record.expires_at,
        deliveries=record.deliveries,
        error=record.error,
        cache=record.cache,
        arm=record.arm,
    )


# -- who lists what ---------------------------------------------------------------------------------------------
def may_list_every_tenant(principal: Principal) -> bool:
    """The operator token, or an operator key of the default tenant (as ``access.require_fleet_operator``)."""
    return principal.tenant is None or (principal.tenant == c.DEFAULT_TENANT and OPERATOR in principal.roles)


def scope_of(principal: Principal, tenant: str | None, model: str | None) -> Scope:
    """The index ``principal`` reads for ``?tenant=`` / ``?model=``. Raises 403 for another tenant's listing."""
    if tenant is not None and not TENANT_RE.match(tenant):
        raise _bad("tenant", f"not a tenant name: {tenant[:64]!r}")
    if model is not None and not c.MODEL_NAME_RE.match(model):
        raise _bad("model", f"not a model name: {model[:64]!r}")
    if may_list_every_tenant(principal):
        return Scope(tenant, model)
    own = tenancy.owner(principal.tenant)
    if tenant is not None and tenant != own:
        raise ApiError(
            403,
            "forbidden",
            f"{principal.subject} belongs to tenant {own!r} and lists only its jobs; another tenant's history needs "
            "the operator token or an operator key of the default tenant",
        )
    return Scope(own, model)


def build_query(
    principal: Principal,
    *,
    model: str | None,
    state: str | None,
    tenant: str | None,
    since: str | None,
    until: str | None,
    limit: int,
) -> Listing:
    if not 1 <= limit <= c.JOB_LIST_MAX_LIMIT:
        raise _bad("limit", f"must be between 1 and {c.JOB_LIST_MAX_LIMIT}, got {limit}")
    start, end = parse_time("since", since), parse_time("until", until)
    if start is not None and end is not None and start > end:
        raise _bad("since", f"since ({since}) is after until ({until})")
    scope = scope_of(principal, tenant, model)
    return Listing(scope, parse_states(state), start, end, limit, may_list_every_tenant(principal))


# -- the scan ---------------------------------------------------------------------------------------------------
async def read_page(state: GatewayState, query: Listing, position: Position | None) -> JobPage:
    """Up to ``query.limit`` jobs after ``position``, reading at most ``JOB_LIST_SCAN_MAX`` index entries."""
    bounded, store = state.bounded, state.store
    jobs: list[JobSummary] = []
    scanned = 0
    while scanned < c.JOB_LIST_SCAN_MAX:
        want = min(max(query.limit - len(jobs), CHUNK_MIN), c.JOB_LIST_MAX_LIMIT, c.JOB_LIST_SCAN_MAX - scanned)
        entries = await bounded(store.index_page(query.scope, query.since, query.until, position, want))
        records = await bounded(store.get_many([e.job_id for e in entries])) if entries else []
        gone: list[Position] = []
        for entry, record in zip(entries, records, strict=True):
            scanned += 1
            position = entry
            if record is None:
                gone.append(entry)
            elif _shown(record, query):
                jobs.append(summary(record))
                if len(jobs) == query.limit:
                    break
        if gone:
            await bounded(store.index_forget(query.scope, gone))
        if len(jobs) == query.limit:
            break
        if len(entries) < want:
            return JobPage(jobs=jobs, next_cursor=None, scanned=scanned)
    assert position is not None  # the loop read at least one entry, or returned
    return JobPage(jobs=jobs, next_cursor=encode_cursor(position, query), scanned=scanned)


def _shown(record: JobRecord, query: Listing) -> bool:
    scope = query.scope
    if not tenancy.visible(record.tenant, scope.tenant):
        return False
    if record.shadow_of is not None and not query.privileged:
        return False
    if scope.model is not None and record.model != scope.model:
        return False
    return query.states is None or record.state in query.states


EXAMPLE_PAGE = {
    "jobs": [
        {
            "job_id": "6f1c2a9e0b6d4f0e9d1f3c7a2b5e8d40",
            "model": "embed",
            "state": "succeeded",
            "tenant": "acme",
            "version": "2",
            "created_at": 1764950400.12,
            "started_at": 1764950400.15,
            "finished_at": 1764950400.19,
            "deliveries": 1,
        }
    ],
    "next_cursor": "eyJiIjoie1wicyI6MTc2NDk1MDQwMC4xMixcImoiOlwiNmYxYy4uLlwifSIsImMiOiI0YjJmIn0",
    "scanned": 1,
}


@router.get(
    "",
    response_model=JobPage,
    summary="List jobs (newest first)",
    description=(
        "The caller's tenant's jobs, newest first, kept as long as their records (`FLEET_JOB_TTL_S`). Filters: "
        "`model`, `state` (comma-separated), `since` / `until` (unix seconds or RFC 3339, inclusive). Pass "
        "`next_cursor` back as `cursor` with the same filters for the next page; `null` means nothing older "
        f"matches. `limit` defaults to {c.JOB_LIST_DEFAULT_LIMIT} (at most {c.JOB_LIST_MAX_LIMIT}); a page reads "
        f"at most {c.JOB_LIST_SCAN_MAX} entries, so a rare state may answer a short page with a cursor. "
        "`tenant` naming another tenant is `403 forbidden`, except for the operator token and the default "
        "tenant's operator keys, which list any tenant (every tenant without `tenant`). A cursor that was altered "
        "or made for another listing is `400 invalid_cursor`."
    ),
    responses={
        **error_responses(400, 403, 422, 503),
        200: {"content": {"application/json": {"example": EXAMPLE_PAGE}}},
    },
)
async def list_jobs(
    model: str | None = Query(None, description="only this model's jobs", examples=["embed"]),
    state: str | None = Query(None, description="only jobs in these states, comma-separated", examples=["failed"]),
    tenant: str | None = Query(None, description="the tenant to list (another than the caller's: operators only)"),
    since: str | None = Query(None, description="created at or after: unix seconds or RFC 3339"),
    until: str | None = Query(None, description="created at or before: unix seconds or RFC 3339"),
    cursor: str | None = Query(None, description="next_cursor of the previous page"),
    limit: int = Query(c.JOB_LIST_DEFAULT_LIMIT, description=f"jobs per page, 1 to {c.JOB_LIST_MAX_LIMIT}"),
    gateway: GatewayState = Depends(gateway_state),
    principal: Principal = Depends(require_submitter),
) -> JobPage:
    query = build_query(principal, model=model, state=state, tenant=tenant, since=since, until=until, limit=limit)
    position = decode_cursor(cursor, query) if cursor is not None else None
    return await read_page(gateway, query, position)
