"""Kafka as a user meets it from outside Fleet's Python: requests produced with ``kcat`` are served by a real
``fleet worker`` process, and bad Kafka configuration stops the ``fleet`` command at start-up with a clear message.

The wire format is the documented one (``fleet.schemas.wire.RequestMessage`` as JSON, the job id as record key); results
are read from Redis with plain redis-py at ``fleet:job:<id>``, dead letters with ``kcat -C``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from fleet import constants as c
from fleet.brokers.kafka import KafkaBroker
from fleet.brokers.kafka_names import bootstrap_servers
from fleet.settings import FleetSettings
from tests.infra import eventually
from tests.processes import fleet_process, run_fleet
from tests.services import require_binary

WORKER = "tests.handlers_for_tests:Items"
JAVA_PARTITIONER = "partitioner=murmur2_random"  # librdkafka's default hashes keys differently from Java clients


@pytest.fixture(scope="module")
def kcat() -> str:
    return require_binary("kcat", "kcat")


@pytest.fixture
def bootstrap(kafka_url: str) -> str:
    return ",".join(bootstrap_servers(kafka_url))


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


def worker_env(kafka_url: str, redis_url: str, model: str, **extra: str) -> dict[str, str]:
    return {
        "FLEET_BROKER_URL": kafka_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_TEST_MODEL_NAME": model,
        "FLEET_ACK_WAIT_S": "5",
        "FLEET_HEARTBEAT_INTERVAL_S": "0.5",
        **extra,
    }


async def run_kcat(kcat: str, *args: str, stdin: bytes = b"") -> str:
    proc = await asyncio.create_subprocess_exec(
        kcat, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 30)
    assert proc.returncode == 0, f"kcat {' '.join(args)} failed ({proc.returncode}): {err.decode()}"
    return out.decode()


async def produce(kcat: str, bootstrap: str, topic: str, body: str, *, key: str | None = None, **headers: str) -> None:
    """One record, as a shell user would send it: ``echo BODY | kcat -P -b ... -t TOPIC -k KEY -H name=value``."""
    args = ["-P", "-b", bootstrap, "-t", topic, "-X", JAVA_PARTITIONER]
    args += ["-k", key] if key is not None else []
    for name, value in headers.items():
        args += ["-H", f"{name.replace('_', '-')}={value}"]
    await run_kcat(kcat, *args, stdin=body.encode() + b"\n")


async def consume_all(kcat: str, bootstrap: str, topic: str) -> list[dict[str, Any]]:
    """Every record now on ``topic`` as kcat's JSON envelope (key, payload, partition, headers)."""
    out = await run_kcat(kcat, "-C", "-b", bootstrap, "-t", topic, "-o", "beginning", "-e", "-J", "-q")
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def topic_exists(kcat: str, bootstrap: str, topic: str) -> bool:
    meta = json.loads(await run_kcat(kcat, "-L", "-b", bootstrap, "-t", topic, "-J"))
    return any(t["topic"] == topic and "error" not in t and t["partitions"] for t in meta["topics"])


def request(job_id: str, model: str, **payload: Any) -> str:
    return json.dumps({"job_id": job_id, "model": model, "input": payload})


async def stored(client: aioredis.Redis, job_id: str) -> dict[str, Any] | None:
    raw = await client.get(c.job_key(job_id))
    return json.loads(raw) if raw is not None else None


async def wait_stored(client: aioredis.Redis, job_id: str, state: str, timeout_s: float = 30) -> dict[str, Any]:
    async def reached() -> bool:
        record = await stored(client, job_id)
        return record is not None and record["state"] == state

    await eventually(reached, timeout_s=timeout_s, what=f"job {job_id} {state} in Redis")
    record = await stored(client, job_id)
    assert record is not None
    return record


async def completions(pubsub: Any, listen_s: float) -> list[dict[str, Any]]:
    """Terminal records announced on the subscribed completion channels within ``listen_s``."""
    deadline = time.monotonic() + listen_s
    out = []
    while (left_s := deadline - time.monotonic()) > 0:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=min(left_s, 0.1))
        if message is not None:
            out.append(json.loads(message["data"]))
    return out


def worker_log(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


# -- requests produced with kcat --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_request_produced_with_kcat_is_served_once_into_redis(
    kcat: str, bootstrap: str, kafka_url: str, redis_url: str, redis_client: aioredis.Redis, unique: str, tmp_path: Path
) -> None:
    model = f"kcat-{unique}"
    topic = c.request_subject(model)
    job_id = f"{unique}-a"
    done = redis_client.pubsub()
    await done.subscribe(c.done_channel(job_id))
    log = tmp_path / "worker.log"
    with fleet_process("worker", "--model", WORKER, env=worker_env(kafka_url, redis_url, model), log=log):
        await eventually(lambda: topic_exists(kcat, bootstrap, topic), timeout_s=60, what=f"topic {topic}")
        body = request(job_id, model, value=21)
        for _ in range(2):  # a producer that retries: the same job id twice
            await produce(kcat, bootstrap, topic, body, key=job_id, fleet_job_id=job_id, fleet_model=model)
        record = await wait_stored(redis_client, job_id, "succeeded")
        notices = await completions(done, listen_s=1.0)  # time for a second result, were one to be produced
    await done.aclose()
    assert record["output"]["value"] == 42, worker_log(log)
    assert record["model"] == model and record["deliveries"] == 1
    assert [n["state"] for n in notices] == ["succeeded"], "one terminal result for a job id sent twice"


@pytest.mark.slow
async def test_malformed_records_from_kcat_are_dead_lettered_and_serving_goes_on(
    kcat: str, bootstrap: str, kafka_url: str, redis_url: str, redis_client: aioredis.Redis, unique: str, tmp_path: Path
) -> None:
    model = f"kbad-{unique}"
    topic, dlq = c.request_subject(model), c.dlq_subject(model)
    wrong_input = f"{unique}-wrong"
    log = tmp_path / "worker.log"
    with fleet_process("worker", "--model", WORKER, env=worker_env(kafka_url, redis_url, model), log=log):
        # The worker creates the request topic, then the dead-letter topic: wait for both before reading either.
        for name in (topic, dlq):
            await eventually(lambda name=name: topic_exists(kcat, bootstrap, name), timeout_s=60, what=f"topic {name}")
        await produce(kcat, bootstrap, topic, "this is not json {")
        await produce(kcat, bootstrap, topic, request(wrong_input, model, value="x"), key=wrong_input)

        async def both_dead() -> bool:
            return len(await consume_all(kcat, bootstrap, dlq)) == 2

        await eventually(both_dead, timeout_s=30, what=f"two dead letters on {dlq}")
        after = f"{unique}-after"
        await produce(kcat, bootstrap, topic, request(after, model, value=5), key=after)
        served = await wait_stored(redis_client, after, "succeeded")
        failed = await wait_stored(redis_client, wrong_input, "failed")
    letters = {json.loads(r["payload"])["job_id"]: r for r in await consume_all(kcat, bootstrap, dlq)}
    garbage, invalid = json.loads(letters[None]["payload"]), json.loads(letters[wrong_input]["payload"])
    assert garbage["raw"] == "this is not json {" and garbage["error"]["type"] == "invalid_request"
    assert "not valid UTF-8 JSON" in garbage["error"]["message"]
    assert invalid["request"]["input"] == {"value": "x"} and "input.value" in invalid["error"]["message"]
    headers = letters[wrong_input]["headers"]
    assert dict(zip(headers[::2], headers[1::2], strict=True))[c.HEADER_ERROR] == "invalid_request"
    assert failed["error"]["type"] == "invalid_request", "the producer can poll why its job failed"
    assert served["output"]["value"] == 10, worker_log(log)


async def test_kcat_with_the_java_partitioner_lands_a_job_id_where_fleet_does(
    kcat: str, bootstrap: str, kafka_url: str, unique: str
) -> None:
    """Same key, same partition as Fleet's own producer: so a copy sent by kcat is dropped as a duplicate."""
    model = f"kpart-{unique}"
    topic = c.request_subject(model)
    broker = KafkaBroker(kafka_url, settings=FleetSettings(broker_url=kafka_url, kafka_partitions=4))
    await broker.connect()
    try:
        await broker.ensure_model(model)
        ids = [f"{unique}-{i}" for i in range(8)]
        for job_id in ids:
            await broker.publish(topic, request(job_id, model).encode(), msg_id=job_id)
        lines = "".join(f"{job_id}\t{request(job_id, model)}\n" for job_id in ids)
        await run_kcat(
            kcat, "-P", "-b", bootstrap, "-t", topic, "-K", "\t", "-X", JAVA_PARTITIONER, stdin=lines.encode()
        )
        records = await consume_all(kcat, bootstrap, topic)
        sub = await broker.subscribe(topic, c.consumer_name(model))
        try:
            delivered = await fetch_until_quiet(sub)
        finally:
            await sub.close()
    finally:
        await broker.close()
    partitions: dict[str, set[int]] = {}
    for record in records:
        partitions.setdefault(record["key"], set()).add(record["partition"])
    assert len(records) == 16 and all(len(p) == 1 for p in partitions.values()), partitions
    assert sorted(d.msg_id for d in delivered) == sorted(ids), "each job id is handed out once"


async def fetch_until_quiet(sub: Any, quiet_s: float = 1.5) -> list[Any]:
    got: list[Any] = []
    while batch := await sub.fetch(100, quiet_s):
        for delivery in batch:
            await delivery.ack()
        got += batch
    return got


# -- bad configuration at start-up, through the CLI ---------------------------------------------------------------


def one_line(text: str) -> str:
    return " ".join(text.split())  # the console wraps long messages


def assert_clean_failure(result: Any, *expected: str) -> None:
    message = one_line(result.stderr)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for text in expected:
        assert text in message, result.stderr


# One start-up attempt: these tests are about how an unreachable Kafka is reported, not about waiting it out.
NO_RETRY: dict[str, Any] = {"env": {"FLEET_STARTUP_TIMEOUT_S": "0"}, "timeout_s": 30}


@pytest.mark.parametrize("command", ["worker", "publish"])
@pytest.mark.services
def test_a_closed_kafka_port_fails_at_once_naming_the_url(command: str) -> None:
    url = "kafka://127.0.0.1:1"
    started = time.monotonic()
    if command == "worker":
        result = run_fleet("worker", "--model", "echo", "--broker", url, "--store", "redis://127.0.0.1:1", **NO_RETRY)
    else:
        result = run_fleet("publish", "--model", "echo", "--broker", url, "-", stdin='{"a": 1}\n', **NO_RETRY)
    assert_clean_failure(result, f"cannot reach Kafka at {url}", "is the broker running")
    assert time.monotonic() - started < 15


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never answers, like a URL pointing at the wrong service."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield server.getsockname()[1]


@pytest.mark.services
def test_a_port_that_never_answers_fails_within_the_connect_timeout(silent_port: int) -> None:
    url = f"kafka://127.0.0.1:{silent_port}"
    started = time.monotonic()
    result = run_fleet("worker", "--model", "echo", "--broker", url, "--store", "redis://127.0.0.1:1", **NO_RETRY)
    assert_clean_failure(result, f"cannot reach Kafka at {url}", "no answer within")
    assert time.monotonic() - started < 20


async def test_missing_topics_with_auto_create_off_are_named_with_the_fix(
    kcat: str, bootstrap: str, kafka_url: str, redis_url: str, unique: str, tmp_path: Path
) -> None:
    model = f"knone-{unique}"
    env = worker_env(kafka_url, redis_url, model, FLEET_KAFKA_AUTO_CREATE="false", FLEET_KAFKA_PARTITIONS="3")
    # Every worker also serves DAG starts: those topics exist once a fleet ran; this test is about the model's.
    await create_topics(bootstrap, {c.DAG_START_SUBJECT: 1, c.dlq_subject("_dagrun"): 1, "fleet.ctl": 1})
    result = await asyncio.to_thread(run_fleet, "worker", "--model", WORKER, env=env, timeout_s=60)
    request_topic, dlq = c.request_subject(model), c.dlq_subject(model)
    levels = [c.request_subject(model, level) for level in c.PRIORITIES]  # one request topic per priority level
    assert_clean_failure(
        result,
        ", ".join(f"'{topic}'" for topic in [*levels, dlq]),
        "kafka_auto_create is off",
        *(f"--create --topic {topic} --partitions 3" for topic in levels),
        f"kafka-topics.sh --bootstrap-server {bootstrap} --create --topic {levels[0]} --partitions 3",
        f"--create --topic {dlq} --partitions 1",
        "or set FLEET_KAFKA_AUTO_CREATE=true",
    )
    assert not await topic_exists(kcat, bootstrap, request_topic), "nothing is created with auto-creation off"

    await create_topics(bootstrap, {**dict.fromkeys(levels, 3), dlq: 1, "fleet.ctl": 1})
    log = tmp_path / "worker.log"
    with fleet_process("worker", "--model", WORKER, env=env, log=log) as proc:

        async def serving() -> bool:
            assert proc.poll() is None, worker_log(log)
            return f"serving {model}" in worker_log(log)

        await eventually(serving, timeout_s=60, what="the worker serving once the topics exist")


async def create_topics(bootstrap: str, topics: dict[str, int]) -> None:
    """What the error message asks the user to do (with the admin API instead of kafka-topics.sh)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        new = [NewTopic(name, count, 1) for name, count in topics.items() if name not in existing]
        await admin.create_topics(new)
    finally:
        await admin.close()
