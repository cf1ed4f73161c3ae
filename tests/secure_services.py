"""Real NATS, Redis and Kafka servers with authentication and TLS on, for ``tests/test_secure_links.py``.

A throwaway CA (``trustme``) signs each server's certificate for ``127.0.0.1`` and ``localhost`` and a client
certificate for mutual TLS; a second CA that signed nothing stands for "an untrusted CA". Every file (CA, keys,
password files, server configs) is written into the server's temporary directory. Servers start on free ports and
stop when the context exits; one that cannot start fails loudly (``ServiceUnavailable``), as in ``tests/services``.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography.hazmat.primitives import serialization

from tests import kafka_service
from tests.services import _server, free_port, require_binary, start_server, stop_server

USER = "fleet"
PASSWORD = "s3cret-Planted-7f3a9c"  # the planted secret the leak tests look for
HOSTS = ("127.0.0.1", "localhost")
PRODUCER = "producer-embed"  # a NATS user that may publish only embed's requests (the docs' permissions block)
PRODUCER_SUBJECTS = ("fleet.req.embed", "fleet.req.embed.high", "fleet.req.embed.low")
SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule"


@dataclass(frozen=True, slots=True)
class Pki:
    """The files of one throwaway CA: its certificate, a server pair and a client pair (for mutual TLS)."""

    ca_file: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_file: Path  # a CA that signed nothing here: the client must refuse the server with it
    password_file: Path

    @classmethod
    def create(cls, folder: Path) -> Pki:
        ca, other = trustme.CA(), trustme.CA()
        server, client = ca.issue_cert(*HOSTS), ca.issue_cert("fleet-client")
        files = {
            "ca_file": ca.cert_pem.bytes(),
            "server_cert": b"".join(p.bytes() for p in server.cert_chain_pems),
            "server_key": _pkcs8(server.private_key_pem.bytes()),
            "client_cert": b"".join(p.bytes() for p in client.cert_chain_pems),
            "client_key": _pkcs8(client.private_key_pem.bytes()),
            "other_ca_file": other.cert_pem.bytes(),
            "password_file": PASSWORD.encode() + b"\n",
        }
        paths = {name: folder / f"{name}.pem" for name in files}
        for name, data in files.items():
            paths[name].write_bytes(data)
            paths[name].chmod(0o600)
        return cls(**paths)


def _pkcs8(pem: bytes) -> bytes:
    """The key as unencrypted PKCS#8, which OpenSSL, Redis and Kafka's PEM key store all read."""
    key = serialization.load_pem_private_key(pem, password=None)
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True, slots=True)
class SecureServer:
    url: str
    pki: Pki


@contextlib.contextmanager
def secure_nats(nkey_public: str) -> Iterator[SecureServer]:
    """nats-server -js with TLS (mutual TLS required) and two users: ``fleet`` with the password, and an NKey user."""
    binary = require_binary("nats-server", "nats-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-nats-tls-") as tmp:
        folder = Path(tmp)
        pki = Pki.create(folder)
        config = folder / "nats.conf"
        config.write_text(
            f"""
listen: 127.0.0.1:{port}
jetstream {{ store_dir: "{folder / "js"}" }}
tls {{
  cert_file: "{pki.server_cert}"
  key_file: "{pki.server_key}"
  ca_file: "{pki.ca_file}"
  verify: true
  timeout: 5
}}
authorization {{
  users: [
    {{ user: "{USER}", password: "{PASSWORD}" }}
    {{ nkey: "{nkey_public}" }}
    {{
      user: "{PRODUCER}", password: "{PASSWORD}"
      permissions: {{
        publish: {{ allow: [{", ".join(f'"{s}"' for s in PRODUCER_SUBJECTS)}] }}
        subscribe: {{ allow: ["_INBOX.>"] }}
      }}
    }}
  ]
}}
"""
        )
        with _server([binary, "-c", str(config)], port, folder, "nats-server (TLS)"):
            yield SecureServer(f"tls://127.0.0.1:{port}", pki)


@contextlib.contextmanager
def secure_redis() -> Iterator[SecureServer]:
    """redis-server on a TLS port only (client certificates optional) with the ACL user ``fleet``; the default
    user is off, so nothing connects without the user's password."""
    binary = require_binary("redis-server", "redis-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-redis-tls-") as tmp:
        folder = Path(tmp)
        pki = Pki.create(folder)
        config = folder / "redis.conf"
        config.write_text(
            f"""
port 0
bind 127.0.0.1
tls-port {port}
tls-cert-file {pki.server_cert}
tls-key-file {pki.server_key}
tls-ca-cert-file {pki.ca_file}
tls-auth-clients optional
save ""
appendonly no
dir {folder}
user default off
user {USER} on >{PASSWORD} ~* &* +@all
"""
        )
        with _server([binary, str(config)], port, folder, "redis-server (TLS)"):
            yield SecureServer(f"rediss://localhost:{port}/0", pki)


@contextlib.contextmanager
def secure_kafka() -> Iterator[SecureServer]:
    """A single-node KRaft Kafka whose only client listener is SASL_SSL with SCRAM-SHA-256 and -512 users
    ``fleet`` (made by ``kafka-storage format --add-scram``); brokers talk to themselves on a loopback listener."""
    java = require_binary("java", "openjdk-17-jre-headless", "Apache Kafka")
    jars = kafka_service.kafka_jars()
    port, internal, controller = free_port(), free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-kafka-sasl-") as tmp:
        folder = Path(tmp)
        pki = Pki.create(folder)
        keystore = folder / "keystore.pem"
        keystore.write_bytes(pki.server_key.read_bytes() + pki.server_cert.read_bytes())
        config = kafka_service.write_config(folder, internal, controller)
        props = {
            "listeners": f"INTERNAL://127.0.0.1:{internal},SASL_SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
            "advertised.listeners": f"INTERNAL://127.0.0.1:{internal},SASL_SSL://127.0.0.1:{port}",
            "listener.security.protocol.map": "INTERNAL:PLAINTEXT,SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "INTERNAL",
            "sasl.enabled.mechanisms": "SCRAM-SHA-256,SCRAM-SHA-512",
            **{
                f"listener.name.sasl_ssl.{m}.sasl.jaas.config": f"{SCRAM_LOGIN} required;"
                for m in ("scram-sha-256", "scram-sha-512")
            },
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(keystore),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(pki.ca_file),
            "ssl.client.auth": "requested",
        }
        lines = [line for line in config.read_text().splitlines() if line.split("=", 1)[0] not in props]
        config.write_text("\n".join([*lines, *(f"{k}={v}" for k, v in props.items())]) + "\n")
        _format_with_scram(java, jars, folder, config)
        proc, logfile = start_server(
            [*kafka_service._java_argv(java, jars, folder, "kafka.Kafka"), str(config)], folder
        )
        try:
            kafka_service._wait_ready(f"127.0.0.1:{internal}", proc, logfile)
            yield SecureServer(f"kafka://127.0.0.1:{port}", pki)
        finally:
            stop_server(proc, kafka_service.STOP_TIMEOUT_S)


def _format_with_scram(java: str, jars: Path, folder: Path, config: Path) -> None:
    import subprocess

    from fleet.errors import ServiceUnavailable

    argv = kafka_service._java_argv(java, jars, folder, "kafka.tools.StorageTool")
    argv += ["format", "--cluster-id", kafka_service.new_cluster_id(), "--config", str(config), "--ignore-formatted"]
    for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
        argv += ["--add-scram", f"{mechanism}=[name={USER},password={PASSWORD}]"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise ServiceUnavailable(
            "Apache Kafka (SASL_SSL)", f"formatting with SCRAM users failed:\n{proc.stderr[-2000:]}"
        )
