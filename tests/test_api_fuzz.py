"""Schemathesis over the gateway's own OpenAPI: a real ``fleet gateway`` process on NATS + Redis with
``FLEET_AUTH=keys`` and tenants' rate limits and quotas on (far above what the fuzz sends), every HTTP operation
fuzzed twice, once with no key and once with an admin key.

Each generated request must get an answer that is not a server error and that the OpenAPI describes: a
documented status code, the documented content type, a body that validates against the response schema and the
documented headers. Examples are bounded (``MAX_EXAMPLES`` per operation and mode) so the suite stays quick; the
Hypothesis database is off so a run depends on its seed alone (a failure prints the reproducing call).

A gateway without a worker is enough: submits queue, long polls end at ``FLEET_MAX_LONG_POLL_S``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import CheckContext, not_a_server_error
from schemathesis.core.transport import Response
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.processes import fleet_process, run_fleet, wait_http_ready
from tests.services import free_port

MAX_EXAMPLES = 12
# The one 5xx a healthy gateway gives by design: a request that runs jobs and whose wait ended first (the jobs go
# on): POST /v1/infer, and POST /v1/embeddings for the embed model. No worker runs here, so every well-formed such
# request ends that way; any other 5xx, and a 500 anywhere, is a failure.
DESIGNED_5XX = {("POST", "/v1/infer", 504), ("POST", "/v1/embeddings", 504)}


def no_server_error(ctx: CheckContext, response: Response, case: schemathesis.Case) -> bool:
    """Schemathesis' ``not_a_server_error``, less the documented 504s of ``DESIGNED_5XX``."""
    if (case.method.upper(), case.path, response.status_code) in DESIGNED_5XX:
        return True
    return bool(not_a_server_error(ctx, response, case) is not False)


CHECKS = [
    no_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@pytest.fixture(scope="module")
def fuzzed_gateway(redis_url: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The base URL of a real gateway (keys on) and an admin key of the tenant ``fuzz``."""
    env = {
        "FLEET_BROKER_URL": nats_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_MODELS": "echo,embed,sleep",
        "FLEET_AUTH": "keys",
        "FLEET_MAX_LONG_POLL_S": "0.3",
        "FLEET_RATE_LIMIT": "1000/s burst 5000",  # on, far above the fuzz: every submit answers RateLimit-* headers
        "FLEET_TENANT_MAX_QUEUED": "100000",
        "FLEET_LOG_LEVEL": "WARNING",
    }
    made = run_fleet("keys", "create", "--tenant", "fuzz", "--role", "admin", env=env)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().splitlines()[-1]
    port = free_port()
    log: Path = tmp_path_factory.mktemp("fuzz") / "gateway.log"
    with fleet_process("gateway", "--port", str(port), env=env, log=log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_http_ready(f"{base}/readyz", proc, log)
        yield {"base": base, "key": key, "log": log}


FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def _streams(operation: schemathesis.APIOperation) -> bool:
    """Whether the operation answers a server-sent event stream: it never ends by itself, so a generic call cannot
    read it whole (tests/test_dag_api.py and tests/test_operator_feed.py test those streams)."""
    ok = operation.definition.raw.get("responses", {}).get("200", {})
    return "text/event-stream" in ok.get("content", {})


def fuzz(base: str, headers: dict[str, str], drop_auth: bool) -> tuple[list[str], Counter[int]]:
    """Fuzz every operation of the gateway's OpenAPI: the failures (one readable entry per operation and mode) and
    how many answers each status code got."""
    statuses: Counter[int] = Counter()
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 20, "the gateway's OpenAPI lists fewer operations than it serves"
    for operation, mode in itertools.product(operations, GenerationMode):
        if _streams(operation):
            continue

        @FUZZ
        @given(case=operation.as_strategy(mode))
        def check(case: schemathesis.Case) -> None:
            sent = {k: v for k, v in (case.headers or {}).items() if not (drop_auth and k.lower() == "authorization")}
            case.headers = {**sent, **headers}
            response = case.call_and_validate(base_url=base, checks=CHECKS, timeout=30)
            statuses[response.status_code] += 1

        try:
            check()
        except Unsatisfiable:  # negative data for an operation that takes no input at all: nothing to send
            continue
        except Exception as exc:  # a failed check: keep going so one run reports every broken operation
            failures.append(f"{operation.label} ({mode.value} data): {exc}")
    return failures, statuses


def test_fuzz_without_a_key(fuzzed_gateway: dict) -> None:
    """No key: every route but the open ones answers 401 with a documented body; nothing is a server error."""
    failures, statuses = fuzz(fuzzed_gateway["base"], {}, drop_auth=True)
    assert not failures, "\n\n".join(failures)
    assert statuses[401] > 100, statuses  # the fuzz met the key check, not only the open routes
    assert statuses[200] > 0, statuses  # health, readiness, metrics and the docs stay open


def test_fuzz_with_an_admin_key(fuzzed_gateway: dict) -> None:
    """An admin key reaches every route's own validation: generated bodies, ids and parameters."""
    failures, statuses = fuzz(fuzzed_gateway["base"], {"Authorization": f"Bearer {fuzzed_gateway['key']}"}, False)
    assert not failures, "\n\n".join(failures)
    assert statuses[401] == 0, statuses  # the key was taken on every route
    assert statuses[202] > 0 and statuses[200] > 50, statuses  # jobs were accepted, routes answered
    assert sum(n for code, n in statuses.items() if 400 <= code < 500) > 50, statuses  # negative data refused
