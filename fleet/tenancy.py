"""Tenants: who owns a job, a DAG run or a result-cache entry, and who may read them.

A record names its tenant in ``tenant``; ``None`` (a field that is absent, as in every record written before
tenants) is the default tenant (``fleet.constants.DEFAULT_TENANT``, the tenant of every request when
``FLEET_AUTH=off``). Records and wire messages of the default tenant leave the field out (``stored``), so they are
byte for byte what they were before.

A *viewer* is the tenant a caller reads as: a key's tenant, ``default`` with auth off, or ``None`` for the
operator token, which is bound to no tenant and reads every tenant's jobs and runs. ``visible`` is the whole check:
a field compare on a record the route has read anyway, so isolation costs no store round trip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleet import constants as c

if TYPE_CHECKING:
    from fleet.schemas.jobs import JobRecord

ALL_TENANTS: str | None = None
"""The viewer that reads every tenant (the operator token; internal callers)."""


def stored(tenant: str | None) -> str | None:
    """The value a record or a wire message carries for ``tenant``: ``None`` for the default tenant."""
    return None if tenant is None or tenant == c.DEFAULT_TENANT else tenant


def owner(tenant: str | None) -> str:
    """The tenant a record's ``tenant`` field names (``None``: the default tenant)."""
    return tenant or c.DEFAULT_TENANT


def visible(record_tenant: str | None, viewer: str | None) -> bool:
    """True when a caller reading as ``viewer`` may see a record of ``record_tenant``."""
    return viewer is None or (record_tenant or c.DEFAULT_TENANT) == viewer


def readable(record: JobRecord, viewer: str | None) -> bool:
    """True when a caller reading as ``viewer`` may read ``record`` by its id: a record of its tenant that is not a
    shadow copy (a traffic policy's mirror, whose output is never returned to a client: only the operator token,
    ``viewer`` None, reads one)."""
    return visible(record.tenant, viewer) and (record.shadow_of is None or viewer is None)
