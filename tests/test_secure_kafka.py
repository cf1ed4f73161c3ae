"""Kafka with SASL/SCRAM over SSL (``fleet.links.kafka_options``) against a real broker configured that way.

A second single-node Kafka, started once for this module (``tests.secure_services.secure_kafka``), has one client
listener, SASL_SSL, with SCRAM-SHA-256 and SCRAM-SHA-512 users signed by a throwaway CA. The session's plain Kafka
is left alone, so no other test sees a changed listener. A job then runs end to end over it and a TLS Redis with an
ACL user, and a wrong password or an untrusted CA gives one clear line naming what failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet import constants as c
from fleet.brokers import make_broker
from fleet.errors import LinkRefused
from fleet.settings import FleetSettings
from tests.gateway_helpers import ObservedWorker, asgi_gateway, model_refs
from tests.infra import TEST_SETTINGS, connected_pair
from tests.processes import run_fleet
from tests.secure_services import PASSWORD, USER, SecureServer, secure_kafka, secure_redis


@pytest.fixture(scope="module")
def sasl_kafka() -> Iterator[SecureServer]:
    with secure_kafka() as server:
        yield server


@pytest.fixture(scope="module")
def tls_redis() -> Iterator[SecureServer]:
    with secure_redis() as server:
        yield server


def kafka_settings(kafka: SecureServer, **overrides: Any) -> dict[str, Any]:
    return {
        "broker_url": kafka.url,
        "kafka_sasl_mechanism": "SCRAM-SHA-512",
        "kafka_user": USER,
        "kafka_password_file": kafka.pki.password_file,
        "kafka_tls_ca_file": kafka.pki.ca_file,
        **overrides,
    }


def redis_settings(redis: SecureServer) -> dict[str, Any]:
    pki = redis.pki
    return {
        "store_url": redis.url,
        "redis_user": USER,
        "redis_password_file": pki.password_file,
        "redis_tls_ca_file": pki.ca_file,
        "redis_tls_cert_file": pki.client_cert,  # the server asks for one optionally: mutual TLS works too
        "redis_tls_key_file": pki.client_key,
    }


async def test_a_job_runs_end_to_end_over_sasl_ssl_kafka_and_no_secret_leaks(
    sasl_kafka: SecureServer, tls_redis: SecureServer, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    refs, (model,) = model_refs(unique, "echo")
    values = {**TEST_SETTINGS, **kafka_settings(sasl_kafka), **redis_settings(tls_redis), "models": refs}
    settings = FleetSettings(**values, kafka_partitions=1)
    beats: list[bytes] = []
    async with connected_pair(settings) as (broker, store):
        await broker.ensure_model(model)
        listener = await broker.listen(c.heartbeat_subject(model))
        got_beat = asyncio.Event()
        collecting = asyncio.create_task(_collect(listener, beats, got_beat))
        async with asgi_gateway(settings) as (_app, client), ObservedWorker(broker, store, model):
            submitted = await client.post("/v1/jobs", json={"model": model, "input": {"hello": unique}})
            assert submitted.status_code == 202, submitted.text
            record = (await client.get(f"/v1/jobs/{submitted.json()['job_id']}?wait=30")).json()
            assert record["state"] == "succeeded" and record["output"] == {"hello": unique}, record
            async with asyncio.timeout(20):
                await got_beat.wait()
            bodies = [(await client.get(path)).text for path in ("/readyz", "/metrics", "/v1/jobs/missing")]
        collecting.cancel()
        await asyncio.gather(collecting, return_exceptions=True)
        await listener.close()
    assert f"connected to Kafka at {sasl_kafka.url}" in caplog.text, "the logs were captured"
    places = {"logs": caplog.text, "endpoints": "\n".join(bodies), "heartbeats": repr(beats)}
    assert {where: PASSWORD in text for where, text in places.items()} == dict.fromkeys(places, False)


async def test_scram_sha_256_with_a_client_certificate_connects(sasl_kafka: SecureServer) -> None:
    pki = sasl_kafka.pki
    values = kafka_settings(
        sasl_kafka,
        kafka_sasl_mechanism="SCRAM-SHA-256",
        kafka_tls_cert_file=pki.client_cert,
        kafka_tls_key_file=pki.client_key,
    )
    broker = make_broker(FleetSettings(**values))
    await broker.connect()
    try:
        await broker.ping()
    finally:
        await broker.close()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("kafka_password_file", "the server refused the credentials (SaslAuthenticationFailed"),
        ("kafka_tls_ca_file", "the TLS handshake failed"),
    ],
)
async def test_a_refused_kafka_link_fails_at_once_naming_what_failed(
    sasl_kafka: SecureServer, tmp_path: Path, change: str, expected: str
) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    value = wrong if change == "kafka_password_file" else sasl_kafka.pki.other_ca_file
    broker = make_broker(FleetSettings(**kafka_settings(sasl_kafka, **{change: value})))
    with pytest.raises(LinkRefused) as caught:
        await broker.connect()
    await broker.close()
    assert caught.value.message.startswith(f"Kafka at {sasl_kafka.url}: {expected}"), caught.value.message
    assert "FLEET_KAFKA_" in caught.value.message and PASSWORD not in caught.value.message


def test_fleet_gateway_says_in_one_line_that_kafka_refused_the_password(
    sasl_kafka: SecureServer, tls_redis: SecureServer, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    values = {**kafka_settings(sasl_kafka, kafka_password_file=wrong), **redis_settings(tls_redis), "models": "echo"}
    done = run_fleet("gateway", env={f"FLEET_{k.upper()}": str(v) for k, v in values.items()})
    assert done.returncode == 1, done.stderr
    expected = f"error: Kafka at {sasl_kafka.url}: the server refused the credentials"
    assert expected in " ".join(done.stderr.split()), done.stderr
    assert "Traceback" not in done.stderr and PASSWORD not in done.stdout + done.stderr


async def _collect(listener: Any, into: list[bytes], got: asyncio.Event) -> None:
    async for _subject, data in listener:
        into.append(data)
        got.set()
