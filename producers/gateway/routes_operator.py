"""``/v1/operator``: how the operator surface is protected, the live snapshot and its stream."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from producers.gateway.operator_access import OperatorGate, operator_gate
from schemas.operator import OperatorAccess

router = APIRouter(prefix="/v1/operator", tags=["operator"])


@router.get("/access", summary="Whether operator calls need a token", response_model=OperatorAccess)
async def access(gate: OperatorGate = Depends(operator_gate)) -> OperatorAccess:
    """No token needed: tells the dashboard whether to show its login form, and whether the controls are off."""
    return gate.access()
