"""Access: who is calling and how much they may do. API keys, roles and the operator token (``auth``), the operator
gate of a gateway without keys (``gate``), principals (``principals``), per-tenant rate limits and quotas
(``ratelimit``), the audit log (``audit``) and the key management routes (``keys``).

This package is the feature's public face: the other features of the gateway import from here, never from its
modules.
"""

from fleet.producers.gateway.access.audit import record_action
from fleet.producers.gateway.access.auth import (
    AUTH_RESPONSES,
    SUBMITTER_DEPS,
    Authenticator,
    require_admin,
    require_fleet_operator,
    require_operator,
    require_submitter,
    websocket_principal,
    ws_subprotocol,
)
from fleet.producers.gateway.access.gate import OperatorGate, is_loopback, log_access, operator_gate
from fleet.producers.gateway.access.principals import ADMIN, ALL_ROLES, OPERATOR, SUBMITTER, Principal
from fleet.producers.gateway.access.ratelimit import (
    RateLimitHeaders,
    build_limiter,
    charge,
    charge_and_create,
    limit_rate,
    limiter_of,
    settled,
)

__all__ = [
    "ADMIN",
    "ALL_ROLES",
    "AUTH_RESPONSES",
    "OPERATOR",
    "SUBMITTER",
    "SUBMITTER_DEPS",
    "Authenticator",
    "OperatorGate",
    "Principal",
    "RateLimitHeaders",
    "build_limiter",
    "charge",
    "charge_and_create",
    "is_loopback",
    "limit_rate",
    "limiter_of",
    "log_access",
    "operator_gate",
    "record_action",
    "require_admin",
    "require_fleet_operator",
    "require_operator",
    "require_submitter",
    "settled",
    "websocket_principal",
    "ws_subprotocol",
]
