"""``GET /v1/usage``: jobs, items, device-seconds and cost per tenant, model, version and device kind.

Who sees what: a caller sees its own tenant's usage only (a key's tenant; ``default`` with keys off), whatever
it groups by; the operator token and operator keys of the default tenant see every tenant's (with keys off: the
callers the operator gate lets in, e.g. the dashboard on a loopback gateway). The counts come from the usage store
(``fleet.store.usage``, hourly buckets); prices from ``FLEET_PRICE_PER_DEVICE_HOUR``.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Query, Request

from fleet import constants as c
from fleet.producers.gateway.access import OPERATOR, Principal, require_operator, require_submitter
from fleet.producers.gateway.errors import ApiError, error_responses
from fleet.producers.gateway.state import GatewayState, gateway_state
from fleet.producers.gateway.usage.report import grouped
from fleet.producers.gateway.usage.window import group_fields, window
from fleet.schemas.usage import UsageReport
from fleet.store.usage import buckets

router = APIRouter(prefix="/v1", tags=["usage"])


async def viewer_of(request: Request, principal: Principal) -> str | None:
    """The tenant whose usage the caller sees; None: every tenant's (see the module docstring)."""
    if principal.subject == "anonymous":  # keys off: whoever the operator gate lets in reads as the operator
        try:
            principal = await require_operator(request, None)
        except ApiError:
            return c.DEFAULT_TENANT
    if OPERATOR in principal.roles and principal.tenant in (None, c.DEFAULT_TENANT):
        return None
    return principal.tenant or c.DEFAULT_TENANT


@router.get(
    "/usage",
    summary="Device-seconds and cost per tenant, model, version and device kind",
    response_model=UsageReport,
    response_model_by_alias=True,
    responses=error_responses(401, 403, 422, 503),
)
async def usage(
    request: Request,
    group_by: str | None = Query(None, description="comma-separated: tenant, model, version, device (default model)"),
    from_: str | None = Query(
        None, alias="from", description="unix seconds, ISO 8601 or a time ago (24h); default: 24 hours before to"
    ),
    to: str | None = Query(None, description="unix seconds, ISO 8601 or a time ago; default: now"),
    principal: Principal = Depends(require_submitter),
    state: GatewayState = Depends(gateway_state),
) -> UsageReport:
    """Usage summed over the hourly buckets that overlap ``[from, to)``; a caller sees only its tenant's."""
    fields = group_fields(group_by)
    since, until = window(from_, to, time.time())
    viewer = await viewer_of(request, principal)
    counts = await state.bounded(state.stores.usage.read(since, until))
    prices = state.settings.price_per_device_hour
    rows, total = grouped(counts, fields, prices, viewer)
    span = buckets(since, until)
    return UsageReport(
        from_=span.start * c.USAGE_BUCKET_S,
        to=span.stop * c.USAGE_BUCKET_S,
        bucket_s=c.USAGE_BUCKET_S,
        group_by=fields,
        currency=state.settings.price_currency,
        prices=dict(prices),
        rows=rows,
        total=total,
    )
