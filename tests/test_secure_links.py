"""Authenticated, encrypted links (``fleet.links``) against real servers configured that way.

A module-scoped nats-server (mutual TLS, a password user and an NKey user) and redis-server (TLS port only, an
ACL user, the default user off) are started with a throwaway CA (``tests.secure_services``). A gateway and a
worker then run a job end to end over them; wrong passwords, an untrusted CA and a missing client certificate give
one clear line naming what failed; and a planted secret never shows in logs, endpoints, heartbeats or records.
Kafka (SASL_SSL with SCRAM) is in ``tests/test_secure_kafka.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nkeys
import pytest
from pydantic import ValidationError

from fleet import constants as c
from fleet.errors import ConfigError, LinkRefused
from fleet.links import redis_options, tls_context
from fleet.redaction import redact, url_has_secret
from fleet.settings import FleetSettings
from fleet.store import make_store
from tests.gateway_helpers import ObservedWorker, asgi_gateway, model_refs
from tests.infra import TEST_SETTINGS, connected_pair
from tests.processes import run_fleet
from tests.secure_services import (
    PASSWORD,
    PRODUCER,
    PRODUCER_SUBJECTS,
    USER,
    SecureServer,
    secure_nats,
    secure_redis,
)

SEED = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


@pytest.fixture(scope="module")
def tls_nats() -> Iterator[SecureServer]:
    with secure_nats(nkeys.from_seed(bytearray(SEED)).public_key.decode()) as server:
        yield server


@pytest.fixture(scope="module")
def tls_redis() -> Iterator[SecureServer]:
    with secure_redis() as server:
        yield server


def nats_settings(nats: SecureServer, **overrides: Any) -> dict[str, Any]:
    pki = nats.pki
    return {
        "broker_url": nats.url,
        "nats_user": USER,
        "nats_password_file": pki.password_file,
        "nats_tls_ca_file": pki.ca_file,
        "nats_tls_cert_file": pki.client_cert,
        "nats_tls_key_file": pki.client_key,
        **overrides,
    }


def redis_settings(redis: SecureServer, **overrides: Any) -> dict[str, Any]:
    return {
        "store_url": redis.url,
        "redis_user": USER,
        "redis_password_file": redis.pki.password_file,
        "redis_tls_ca_file": redis.pki.ca_file,
        **overrides,
    }


def env_of(values: dict[str, Any]) -> dict[str, str]:
    return {f"FLEET_{name.upper()}": str(value) for name, value in values.items()}


# -- settings and URLs (pure) ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:6379/0", "redis://***@h:6379/0"),
        ("rediss://user:pw@h:6379/0", "rediss://user:***@h:6379/0"),
        ("nats://token@h:4222", "nats://***@h:4222"),
        ("nats://a:p@h1:4222,nats://b:q@h2:4222", "nats://a:***@h1:4222,nats://b:***@h2:4222"),
        ("redis://h:6379/0?password=pw&socket_timeout=2", "redis://h:6379/0?password=***&socket_timeout=2"),
        ("redis://h:6379/0?socket_timeout=2", "redis://h:6379/0?socket_timeout=2"),
        ("kafka://h1:9092,h2:9092", "kafka://h1:9092,h2:9092"),
    ],
)
def test_redact_hides_every_secret_of_a_url(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert url_has_secret(url) is (url != shown)


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"nats_user": "u"}, "nats_user and nats_password_file"),
        ({"nats_creds_file": "a", "nats_nkey_seed_file": "b"}, "set at most one"),
        ({"kafka_user": "u", "kafka_password_file": "p"}, "kafka_sasl_mechanism and kafka_user"),
        ({"kafka_sasl_mechanism": "SCRAM-SHA-512"}, "kafka_sasl_mechanism and kafka_user"),
        ({"redis_user": "u"}, "redis_user needs redis_password_file"),
        ({"redis_tls_key_file": "k"}, "redis_tls_key_file needs redis_tls_cert_file"),
        ({"store_url": "redis://h:6379/0", "redis_tls_ca_file": "ca"}, "write rediss://"),
        ({"broker_url": "nats://h:4222", "nats_tls_ca_file": "ca"}, "write tls://"),
        ({"broker_url": "tls://a:4222,nats://b:4222"}, "every NATS server with tls://"),
    ],
)
def test_contradicting_link_settings_are_refused_naming_them(values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ValidationError, match=complaint):
        FleetSettings(**values)


def test_a_secret_file_that_cannot_be_read_is_named_without_its_text(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    base = {"store_url": "redis://h:6379/0"}
    with pytest.raises(ConfigError, match=r"cannot read the Redis password file .*missing: No such file"):
        redis_options(FleetSettings(**base, redis_password_file=tmp_path / "missing"))
    with pytest.raises(ConfigError, match="is empty"):
        redis_options(FleetSettings(**base, redis_password_file=empty))
    secret = tmp_path / "pw"
    secret.write_text(f"  {PASSWORD}\n")
    settings = FleetSettings(**base, redis_user="app", redis_password_file=secret)
    assert redis_options(settings) == {"password": PASSWORD, "username": "app"}
    assert PASSWORD not in repr(settings) and PASSWORD not in settings.model_dump_json()


@pytest.mark.services
def test_the_cli_refuses_a_password_in_a_url_flag_without_echoing_it() -> None:
    done = run_fleet("gateway", "--broker", "nats://127.0.0.1:1", "--store", f"redis://:{PASSWORD}@127.0.0.1:1/0")
    assert done.returncode == 2, done.stderr
    assert "--store redis://***@127.0.0.1:1/0: a password or token on the command line is refused" in done.stderr
    assert PASSWORD not in done.stdout + done.stderr and "Traceback" not in done.stderr


# -- real servers ---------------------------------------------------------------------------------------------


async def test_a_job_runs_end_to_end_over_tls_nats_and_tls_redis_and_no_secret_leaks(
    tls_nats: SecureServer, tls_redis: SecureServer, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    refs, (model,) = model_refs(unique, "echo")
    values = {**TEST_SETTINGS, **nats_settings(tls_nats), **redis_settings(tls_redis), "models": refs}
    settings = FleetSettings(**values)
    beats: list[bytes] = []
    async with connected_pair(settings) as (broker, store):
        listener = await broker.listen(c.heartbeat_subject(model))
        collecting = asyncio.create_task(_collect(listener, beats))
        async with asgi_gateway(settings) as (_app, client), ObservedWorker(broker, store, model):
            submitted = await client.post("/v1/jobs", json={"model": model, "input": {"hello": unique}})
            assert submitted.status_code == 202, submitted.text
            answer = await client.get(f"/v1/jobs/{submitted.json()['job_id']}?wait=20")
            record = answer.json()
            assert record["state"] == "succeeded" and record["output"] == {"hello": unique}, record
            await asyncio.sleep(1.2)  # a few heartbeats (every 0.2 s in TEST_SETTINGS)
            bodies = [
                (await client.get(path)).text
                for path in ("/readyz", "/healthz", "/metrics", "/v1/models", "/v1/jobs/missing", "/v1/scaling")
            ]
            bodies.append((await client.post("/v1/jobs", content=b"{not json")).text)
        collecting.cancel()
        await asyncio.gather(collecting, return_exceptions=True)
        await listener.close()
        stored = await _all_values(store)
    assert beats, "the worker's heartbeats crossed the TLS link"
    assert f"connected to NATS at {tls_nats.url}" in caplog.text, "the logs were captured (DEBUG and up)"
    assert any(record["job_id"] in value for value in stored), "the job record is in the TLS Redis"
    places = {"logs": caplog.text, "endpoints": "\n".join(bodies), "heartbeats": repr(beats), "redis": repr(stored)}
    assert {where: PASSWORD in text for where, text in places.items()} == dict.fromkeys(places, False)


async def test_an_nkey_user_connects_over_mutual_tls(tls_nats: SecureServer, tmp_path: Path) -> None:
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(SEED)
    values = nats_settings(tls_nats, nats_user=None, nats_password_file=None, nats_nkey_seed_file=seed_file)
    async with connected_pair(FleetSettings(**values)) as (broker, _store):
        await broker.ping()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"nats_password_file": "wrong"}, "NATS at tls://127.0.0.1:PORT: the server refused the credentials"),
        ({"nats_tls_ca_file": "other"}, "NATS at tls://127.0.0.1:PORT: the TLS handshake failed"),
        ({"nats_tls_cert_file": None, "nats_tls_key_file": None}, "the server refused the TLS client"),
    ],
)
async def test_a_refused_nats_link_fails_at_once_naming_what_failed(
    tls_nats: SecureServer, tmp_path: Path, change: dict[str, Any], expected: str
) -> None:
    values = nats_settings(tls_nats, **_resolve(change, tls_nats, tmp_path))
    broker = FleetSettings(**values)
    from fleet.brokers import make_broker

    nats = make_broker(broker)
    with pytest.raises(LinkRefused) as caught:
        await nats.connect()
    await nats.close()
    assert not caught.value.retriable
    assert expected.replace("PORT", tls_nats.url.rsplit(":", 1)[1]) in caught.value.message
    assert PASSWORD not in caught.value.message


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"redis_password_file": "wrong"}, "the server refused the credentials"),
        ({"redis_user": None, "redis_password_file": None}, "the server refused the credentials"),
        ({"redis_tls_ca_file": "other"}, "the TLS handshake failed"),
    ],
)
async def test_a_refused_redis_link_fails_at_once_naming_what_failed(
    tls_redis: SecureServer, tmp_path: Path, change: dict[str, Any], expected: str
) -> None:
    store = make_store(FleetSettings(**redis_settings(tls_redis, **_resolve(change, tls_redis, tmp_path))))
    with pytest.raises(LinkRefused) as caught:
        await store.connect()
    await store.close()
    assert caught.value.message.startswith(f"Redis at {tls_redis.url}: {expected}")
    assert "FLEET_REDIS" in caught.value.message and PASSWORD not in caught.value.message


async def test_nats_permissions_keep_a_producer_to_its_own_subjects(tls_nats: SecureServer) -> None:
    """The permissions block of docs/guides/real-infrastructure.md: ``producer-embed`` gets a PubAck on embed's
    subject, and the server refuses its publish on another model's subject (no PubAck, a permissions violation)."""
    async with connected_pair(FleetSettings(**nats_settings(tls_nats))) as (_broker, _store):
        pass  # a Fleet process created the streams (a producer may not)
    refused: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        refused.append(exc)

    tls = tls_context(tls_nats.pki.ca_file, tls_nats.pki.client_cert, tls_nats.pki.client_key, "NATS")
    nc = await nats.connect(
        tls_nats.url, user=PRODUCER, password=PASSWORD, tls=tls, error_cb=on_error, allow_reconnect=False
    )
    try:
        js = nc.jetstream(timeout=3)
        ack = await js.publish(PRODUCER_SUBJECTS[0], b"{}", headers={"Nats-Msg-Id": f"p-{os.urandom(4).hex()}"})
        assert ack.stream == c.REQ_STREAM
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(c.request_subject("echo"), b"{}", timeout=1.5)
    finally:
        await nc.close()
    assert any("permissions violation" in str(exc).lower() for exc in refused), refused


def test_fleet_worker_says_in_one_line_which_link_was_refused(
    tls_nats: SecureServer, tls_redis: SecureServer, tmp_path: Path
) -> None:
    """One process (each costs seconds to start): the worker, refused by Redis after NATS let it in. The gateway's
    start-up is held to the same line by ``tests/test_secure_kafka.py``."""
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    values = {**nats_settings(tls_nats), **redis_settings(tls_redis, redis_password_file=wrong)}
    done = run_fleet("worker", "--model", "echo", env=env_of({**values, "startup_timeout_s": 30, "models": "echo"}))
    assert done.returncode == 1, done.stderr
    line = f"error: Redis at {tls_redis.url}: the server refused the credentials"
    assert line in " ".join(done.stderr.split()), done.stderr
    assert "Traceback" not in done.stderr and PASSWORD not in done.stdout + done.stderr
    assert "attempts" not in done.stderr, "a refused link is not retried until the start-up deadline"


def _resolve(change: dict[str, Any], server: SecureServer, tmp_path: Path) -> dict[str, Any]:
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    names = {"wrong": wrong, "other": server.pki.other_ca_file}
    return {key: names.get(value, value) if isinstance(value, str) else value for key, value in change.items()}


async def _collect(listener: Any, into: list[bytes]) -> None:
    async for _subject, data in listener:
        into.append(data)


async def _all_values(store: Any) -> list[str]:
    redis = store.redis
    out: list[str] = []
    async for key in redis.scan_iter(count=500):
        kind = await redis.type(key)
        if kind == b"string":
            out.append((await redis.get(key) or b"").decode(errors="replace"))
        elif kind == b"hash":
            out.append(repr(await redis.hgetall(key)))
    return out
