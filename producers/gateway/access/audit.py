"""The audit log of operator and admin actions, written by the routes that act (``record_action``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import Request

from fleet.errors import FleetError
from fleet.producers.gateway.access.principals import Principal
from fleet.producers.gateway.state import state_of
from fleet.schemas.keys import AuditEntry
from fleet.store.audit import AuditLog

log = logging.getLogger(__name__)


async def record_action(
    request: Request, principal: Principal, action: str, target: str | None, details: dict[str, Any]
) -> None:
    """Append an operator action to the audit log. The action already happened: a log that cannot be written is
    logged as an error (with the entry), not turned into a failed answer."""
    entry = AuditEntry(
        at=time.time(),
        action=action,
        actor=principal.subject,
        key_id=principal.key_id,
        tenant=principal.tenant,
        target=target,
        details=details,
    )
    audit: AuditLog = state_of(request).stores.audit
    try:
        await audit.append(entry)
    except FleetError as exc:
        log.error("audit log: could not record %s: %s", entry.model_dump_json(), exc.message)
