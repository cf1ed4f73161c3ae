"""API keys and the audit log: what ``fleet keys`` and ``/v1/keys`` show, and one audit entry.

A key's record never holds the key: only its id (the public part of the key), tenant, role and times. The
secret is shown once, when the key is created (``KeyCreated.key``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Role = Literal["submitter", "operator", "admin"]


class KeyInfo(BaseModel):
    """One API key as listed: everything but the key itself."""

    key_id: str = Field(description="the key's public id: the key reads 'fleet_<key_id>_<secret>'")
    prefix: str = Field(description="how the key starts ('fleet_<key_id>_'), to recognise it")
    tenant: str = Field(description="the tenant whose jobs and runs the key's requests belong to")
    role: Role = Field(description="submitter < operator < admin: each role holds the ones before it")
    created_at: float = Field(description="unix seconds")
    expires_at: float | None = Field(None, description="unix seconds; null: never")
    revoked_at: float | None = Field(None, description="unix seconds; null: not revoked")

    def status(self, now: float) -> str:
        """``active``, ``expired`` or ``revoked``."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


class KeyList(BaseModel):
    """``GET /v1/keys``."""

    keys: list[KeyInfo]


class CreateKeyRequest(BaseModel):
    """``POST /v1/keys``."""

    model_config = {"extra": "forbid"}

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    role: Role
    expires: str | None = Field(
        None, max_length=64, description="a duration ('30d', '12h', '90m', '3600s') or an ISO-8601 time"
    )


class KeyCreated(BaseModel):
    """A new key: ``key`` is shown this once and cannot be read back."""

    key: str = Field(description="the secret API key: send it as 'Authorization: Bearer <key>'")
    info: KeyInfo


class AuditEntry(BaseModel):
    """One operator action, as the audit log keeps it."""

    at: float = Field(description="unix seconds")
    action: str = Field(description="e.g. scaling.update, scaling.scale, worker.drain, deadletters.redrive, key.create")
    actor: str = Field(description="who: 'key:<id>', 'operator-token', 'local' (auth off, loopback) or 'cli'")
    key_id: str | None = Field(None, description="the API key that made the call, when one did")
    tenant: str | None = Field(None, description="that key's tenant")
    target: str | None = Field(None, description="what it acted on: a model, a worker id, a key id")
    details: dict[str, Any] = Field(default_factory=dict, description="the request's parameters and its outcome")


class AuditList(BaseModel):
    """``GET /v1/audit``: the newest entries first."""

    entries: list[AuditEntry]
