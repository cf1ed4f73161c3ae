"""The usage report of ``GET /v1/usage``: jobs, items, device-seconds and their cost, grouped as asked."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

GroupField = Literal["tenant", "model", "version", "device"]
GROUP_FIELDS: tuple[GroupField, ...] = ("tenant", "model", "version", "device")


class UsageRow(BaseModel):
    """One group's usage; the fields not grouped by are null."""

    tenant: str | None = None
    model: str | None = None
    version: str | None = None
    device: str | None = Field(None, description="the device kind: cpu, cuda, ...")
    jobs: int = Field(description="jobs computed (their results stored)")
    items: int = Field(description="their items: the model's cost of each request (texts, tokens...)")
    device_seconds: float = Field(description="device time, each batch's compute shared by its items' costs")
    cost: float = Field(description="device-hours times the price of their device kind (none priced: 0)")
    cost_per_1k_requests: float | None = Field(description="cost per 1,000 jobs (null without jobs)")


class UsageReport(BaseModel):
    """Usage between ``from`` and ``to`` (unix seconds, widened to whole buckets), grouped by ``group_by``."""

    model_config = {"populate_by_name": True}

    from_: float = Field(alias="from", description="unix seconds: the start of the first bucket summed")
    to: float = Field(description="unix seconds: the end of the last bucket summed")
    bucket_s: int = Field(description="the counts' time resolution")
    group_by: list[GroupField]
    currency: str
    prices: dict[str, float] = Field(description="the price of a device-hour per device kind")
    rows: list[UsageRow] = Field(description="largest device-seconds first")
    total: UsageRow = Field(description="every row summed (no group fields)")
