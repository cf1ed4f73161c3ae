"""Who is calling: a ``Principal`` with its roles (submitter < operator < admin) and tenant. A leaf of the access
feature: the authenticator and the operator gate both give principals, and neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet import constants as c

SUBMITTER, OPERATOR, ADMIN = c.ROLES
ALL_ROLES = frozenset(c.ROLES)


def roles_of(role: str) -> frozenset[str]:
    """The roles a key of ``role`` holds: its own and every lower one."""
    return frozenset(c.ROLES[: c.ROLES.index(role) + 1])


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling, and what they may do. ``tenant`` owns the jobs and runs they submit (None: the operator
    token, bound to no tenant); ``key_id`` names the API key (None without one)."""

    subject: str
    roles: frozenset[str]
    tenant: str | None = None
    key_id: str | None = None


ANONYMOUS = Principal("anonymous", frozenset({SUBMITTER}), tenant=c.DEFAULT_TENANT)
