"""The jobs of one request of the OpenAI-compatible and rerank routes: submitted in order, awaited together.

1. Each job is submitted through the jobs feature's ``submit_body``, the path of ``POST /v1/jobs`` and
   ``POST /v1/infer`` once they have parsed their body: model and input checks, result caches, the tenant's rate
   and quota, the model's queue bound, metrics. One at a time, in order: the tenant's quota keeps the place a
   submit took in the request's state until that submit settles.
2. All are then awaited together until one shared deadline (``default_wait_s``: ``POST /v1/infer``'s default).
3. The outputs come back in the order of the inputs; the first job that did not succeed answers for the request
   with ``POST /v1/infer``'s error (``504 infer_timeout``, ``400`` for an input a worker refused, ...).

A refusal part way (the tenant's rate limit at the third of five jobs) answers the refusal; the jobs already
submitted still run and their results are kept as any job's (``GET /v1/jobs/{id}``), unused by this request.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi import Request

from fleet.producers.gateway import jobs
from fleet.producers.gateway.access import Principal
from fleet.producers.gateway.state import GatewayState
from fleet.schemas.api import SubmitRequest

CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb for English text


def estimated_tokens(texts: list[str]) -> int:
    """The tokens of ``texts`` where a model reports none: one per ``CHARS_PER_TOKEN`` characters, at least one
    per text (what ``usage`` says then; the docs say it is an estimate)."""
    return sum(max(1, math.ceil(len(text) / CHARS_PER_TOKEN)) for text in texts)


async def run_jobs(
    request: Request,
    state: GatewayState,
    principal: Principal,
    bodies: list[SubmitRequest],
) -> list[Any]:
    """The outputs of the jobs ``bodies`` (in their order), each submitted for ``principal``'s tenant.

    Raises:
        ApiError / FleetError: the refusal of a submit, or the answer of the first job that did not succeed within
            the wait (as ``POST /v1/infer`` answers it).
    """
    wait_s = jobs.default_wait_s(state)
    deadline = asyncio.get_running_loop().time() + wait_s
    job_ids = [(await jobs.submit_body(request, state, principal, body)).job_id for body in bodies]
    ended = await asyncio.gather(
        *(jobs.wait_for_end(state, principal, job_id, deadline) for job_id in job_ids), return_exceptions=True
    )
    outputs = []
    for record in ended:
        if isinstance(record, BaseException):
            raise record
        outputs.append(jobs.answer(record, wait_s).output)
    return outputs
