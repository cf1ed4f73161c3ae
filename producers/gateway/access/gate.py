"""Who may use the operator surface when API keys are off (``FLEET_AUTH=off``): the operator gate.

The check is "the caller's principal has the ``operator`` role" (``fleet.producers.gateway.access.require_operator``).
With ``FLEET_AUTH=off`` the gate gives such a principal:

* ``FLEET_OPERATOR_TOKEN`` set: ``Authorization: Bearer <token>`` (compared in constant time). No header: 401 with
  ``WWW-Authenticate: Bearer``; another token: 403.
* Token unset: the surface is open when the gateway is bound to a loopback address (``settings.host``, the
  ``fleet up`` default 127.0.0.1), since only this machine can reach it; bound to any other address it answers
  403 ``operator_disabled`` saying to set the token (logged once at start-up).

With ``FLEET_AUTH=keys`` an API key with the operator (or admin) role gives it, and the token still does
(``fleet.producers.gateway.access.auth``).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from dataclasses import dataclass

from fastapi import Request

from fleet.producers.gateway.access.principals import ALL_ROLES, Principal
from fleet.producers.gateway.errors import ApiError
from fleet.schemas.operator import OperatorAccess
from fleet.settings import FleetSettings

log = logging.getLogger(__name__)

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) only accepts connections from this machine."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class OperatorGate:
    """The access rule of one gateway, fixed at start-up from its settings."""

    token: str | None
    loopback: bool
    host: str
    keys: bool = False  # FLEET_AUTH=keys: API keys decide, the gate only lends its token

    @classmethod
    def from_settings(cls, settings: FleetSettings) -> OperatorGate:
        token = settings.operator_token.get_secret_value() if settings.operator_token else None
        loopback = is_loopback(settings.host)
        return cls(token=token or None, loopback=loopback, host=settings.host, keys=settings.auth == "keys")

    @property
    def disabled_reason(self) -> str | None:
        if self.keys or self.token is not None or self.loopback:
            return None
        return (
            f"the operator dashboard and API are off: this gateway listens on {self.host}, which is not a loopback "
            "address, and FLEET_OPERATOR_TOKEN is not set; set FLEET_OPERATOR_TOKEN to a secret (or bind to 127.0.0.1)"
        )

    def access(self) -> OperatorAccess:
        reason = self.disabled_reason
        return OperatorAccess(
            token_required=self.keys or self.token is not None,
            enabled=reason is None,
            reason=reason,
            auth="keys" if self.keys else "off",
        )

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller's principal; raises ``ApiError`` 401/403 as the module docstring says."""
        reason = self.disabled_reason
        if reason is not None:
            raise ApiError(403, "operator_disabled", reason)
        if self.token is None:
            return Principal("local", ALL_ROLES)
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise ApiError(
                401,
                "unauthorized",
                "this operator call needs 'Authorization: Bearer <FLEET_OPERATOR_TOKEN>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(presented.strip().encode(), self.token.encode()):
            raise ApiError(403, "forbidden", "the operator token is not valid")
        return Principal("operator-token", ALL_ROLES)


def _gate(request: Request) -> OperatorGate:
    gate: OperatorGate = request.app.state.gateway.authenticator.gate  # the state holds the authenticator's type
    return gate


async def operator_gate(request: Request) -> OperatorGate:
    """FastAPI dependency: the gate the lifespan built (async: a sync dependency would cost a thread hop)."""
    return _gate(request)


def log_access(gate: OperatorGate) -> None:
    """Say once at start-up how the operator surface is protected."""
    reason = gate.disabled_reason
    if reason is not None:
        log.warning("%s", reason)
    elif gate.keys:
        log.info(
            "API keys on (FLEET_AUTH=keys): operator calls need a key with the operator role%s",
            " or FLEET_OPERATOR_TOKEN" if gate.token else "",
        )
    elif gate.token is None:
        log.info("operator dashboard and API open to this machine (bound to %s, no FLEET_OPERATOR_TOKEN)", gate.host)
    else:
        log.info("operator dashboard and API need the FLEET_OPERATOR_TOKEN bearer token")
