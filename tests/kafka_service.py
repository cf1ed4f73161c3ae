"""A real Apache Kafka 4.x broker for the tests: a single KRaft node (broker and controller) on free ports.

``FLEET_TEST_KAFKA_URL`` (``kafka://host:port``) points the tests at a running broker instead. Otherwise:

1. The broker's jars come from Maven Central through Maven itself: ``mvn dependency:copy-dependencies`` on
   ``scripts/kafka/pom.xml`` (which names ``org.apache.kafka:kafka_2.13``). They are cached under
   ``~/.cache/fleet/kafka-<version>-<pom hash>/`` and reused while the pom is unchanged.
2. A ``server.properties`` tuned for tests is written to a temporary directory, the storage is formatted with
   ``kafka.tools.StorageTool`` and ``kafka.Kafka`` is started on the machine's Java 17 with a small heap.
3. The node is ready when a real Kafka request (a metadata request through aiokafka's admin client) lists the
   broker; it is stopped at the end of the session.

Anything that fails raises ``ServiceUnavailable`` with the reason and what to do about it.

``python -m tests.kafka_service`` starts one by hand and prints its URL (for ``FLEET_TEST_KAFKA_URL``); Ctrl-C stops it.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from fleet.errors import ServiceUnavailable
from tests.services import free_port, port_open, require_binary, start_server, stop_server

log = logging.getLogger(__name__)

POM = Path(__file__).resolve().parent.parent / "scripts" / "kafka" / "pom.xml"
HEAP = "-Xmx512m"
DOWNLOAD_TIMEOUT_S = 600.0
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0

# Tuned for a single-node test broker: everything replicated once, rebalances without the initial delay, short
# session timeouts allowed (tests lower them to make consumer hand-over quick), topics only created explicitly.
BROKER_PROPERTIES = {
    "process.roles": "broker,controller",
    "node.id": "1",
    "controller.listener.names": "CONTROLLER",
    "inter.broker.listener.name": "PLAINTEXT",
    "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    "num.partitions": "1",
    "default.replication.factor": "1",
    "min.insync.replicas": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    "group.min.session.timeout.ms": "500",
    "group.coordinator.append.linger.ms": "0",  # commit offsets at once (the 5 ms default batches commits)
    "auto.create.topics.enable": "false",
    "num.network.threads": "2",
    "num.io.threads": "4",
    "log.flush.interval.messages": "9223372036854775807",
}

LOG4J2 = """\
status = error
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.stdout.ref = STDOUT
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
"""


def kafka_version() -> str:
    """The Kafka version that ``scripts/kafka/pom.xml`` names."""
    match = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text())
    if match is None:
        raise ServiceUnavailable("Apache Kafka", f"{POM} does not set <kafka.version>")
    return match.group(1).strip()


def cache_dir() -> Path:
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:8]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fleet" / f"kafka-{kafka_version()}-{digest}"


def kafka_jars() -> Path:
    """The folder of broker jars, fetched by Maven on first use and cached (a lock guards parallel runs)."""
    root = cache_dir()
    jars, done = root / "jars", root / ".complete"
    if done.exists():
        return jars
    mvn = require_binary("mvn", "maven", "Apache Kafka")
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _download(mvn, jars)
            done.touch()
    return jars


def _download(mvn: str, jars: Path) -> None:
    shutil.rmtree(jars, ignore_errors=True)
    argv = [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies", "-DincludeScope=runtime"]
    argv.append(f"-DoutputDirectory={jars}")
    started = time.monotonic()
    log.warning("fetching Apache Kafka %s jars with Maven into %s", kafka_version(), jars)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ServiceUnavailable("Apache Kafka", f"Maven did not fetch the jars within {DOWNLOAD_TIMEOUT_S}s") from exc
    if proc.returncode != 0 or not any(jars.glob("kafka_2.13-*.jar")):
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise ServiceUnavailable(
            "Apache Kafka",
            f"'{' '.join(argv)}' failed (exit {proc.returncode}); Maven Central must be reachable on the first "
            f"run, or set FLEET_TEST_KAFKA_URL=kafka://host:port to use a running broker. Maven said:\n{tail}",
        )
    log.warning("fetched the Kafka jars in %.1fs", time.monotonic() - started)


def write_config(workdir: Path, port: int, controller_port: int) -> Path:
    props = dict(BROKER_PROPERTIES)
    props["listeners"] = f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}"
    props["advertised.listeners"] = f"PLAINTEXT://127.0.0.1:{port}"
    props["controller.quorum.voters"] = f"1@127.0.0.1:{controller_port}"
    props["log.dirs"] = str(workdir / "data")
    path = workdir / "server.properties"
    path.write_text("".join(f"{key}={value}\n" for key, value in props.items()))
    (workdir / "log4j2.properties").write_text(LOG4J2)
    return path


def _java_argv(java: str, jars: Path, workdir: Path, main: str) -> list[str]:
    return [
        java,
        HEAP,
        "-Xms128m",
        "-XX:+UseSerialGC",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={workdir / 'log4j2.properties'}",
        "-cp",
        f"{jars}/*",
        main,
    ]


def new_cluster_id() -> str:
    """A random KRaft cluster id, as Kafka's own ``Uuid.randomUuid`` makes it.

    The id is URL-safe base64, so one in 64 starts with ``-``, which the storage tool's argument parser reads as
    an option; Kafka draws again in that case, and so do we.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def format_storage(java: str, jars: Path, workdir: Path, config: Path) -> None:
    cluster_id = new_cluster_id()
    argv = _java_argv(java, jars, workdir, "kafka.tools.StorageTool")
    argv += ["format", "--cluster-id", cluster_id, "--config", str(config), "--ignore-formatted"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise ServiceUnavailable(
            "Apache Kafka", f"formatting the KRaft storage failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )


async def _probe(bootstrap: str) -> bool:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
    try:
        await asyncio.wait_for(admin.start(), 3)
        cluster = await asyncio.wait_for(admin.describe_cluster(), 3)
        return bool(cluster.get("brokers"))
    except Exception:  # not up yet: the caller retries until its deadline
        return False
    finally:
        await admin.close()


def kafka_answers(bootstrap: str) -> bool:
    """True when a Kafka metadata request to ``bootstrap`` lists a broker (run in a thread: a loop may be running)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _probe(bootstrap)).result()


def _wait_ready(bootstrap: str, proc: subprocess.Popen[bytes], logfile: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        host, port = bootstrap.rsplit(":", 1)
        if port_open(host, int(port)) and kafka_answers(bootstrap):
            return
        time.sleep(0.2)
    proc.kill()
    tail = logfile.read_text(errors="replace")[-3000:] if logfile.exists() else ""
    status = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {START_TIMEOUT_S}s"
    raise ServiceUnavailable("Apache Kafka", f"the test broker on {bootstrap} {status}. Its log ends:\n{tail}")


@contextlib.contextmanager
def kafka_server() -> Iterator[str]:
    """Yield ``kafka://127.0.0.1:PORT`` of a single-node Kafka started for the session (or FLEET_TEST_KAFKA_URL)."""
    url = os.environ.get("FLEET_TEST_KAFKA_URL")
    if url:
        yield url
        return
    java = require_binary("java", "openjdk-17-jre-headless", "Apache Kafka")
    jars = kafka_jars()
    port, controller_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-kafka-") as tmp:
        workdir = Path(tmp)
        config = write_config(workdir, port, controller_port)
        started = time.monotonic()
        format_storage(java, jars, workdir, config)
        proc, logfile = start_server([*_java_argv(java, jars, workdir, "kafka.Kafka"), str(config)], workdir)
        try:
            _wait_ready(f"127.0.0.1:{port}", proc, logfile)
            log.warning("Kafka %s ready on 127.0.0.1:%d in %.1fs", kafka_version(), port, time.monotonic() - started)
            yield f"kafka://127.0.0.1:{port}"
        finally:
            stop_server(proc, STOP_TIMEOUT_S)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with kafka_server() as kafka_url, contextlib.suppress(KeyboardInterrupt):
        print(f"FLEET_TEST_KAFKA_URL={kafka_url}", flush=True)
        signal.pause()
