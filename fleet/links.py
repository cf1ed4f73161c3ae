"""Authenticated, encrypted links to NATS, Kafka and Redis: one builder of connection options per kind.

Every Fleet client of a broker or store gets its credentials and TLS from here, built from ``FleetSettings``:

* ``nats_options``: a ``.creds`` file (JWT + NKey seed), an NKey seed file, or a user with a password file;
  TLS (``tls://`` servers) with a CA file and an optional client certificate for mutual TLS.
* ``kafka_options``: SASL (SCRAM-SHA-256, SCRAM-SHA-512 or PLAIN) with a user and a password file; SSL with a CA
  file and an optional client certificate. The security protocol follows from them (``SASL_SSL``...).
* ``redis_options``: an ACL user (or the default user) with a password file; ``rediss://`` with a CA file and an
  optional client certificate.

Secrets are only ever read from files (never from a flag or a setting's value), when a client is built, and they
go straight into the client library's options: they are in no setting's repr, no log line and no message.
A password written inside a URL (``redis://:pw@host``, ``nats://user:pw@host``) still works, for deployments that
keep the whole URL in a secret, but it is refused as a command-line flag by the CLI and ``fleet.redaction.redact``
removes it from every URL Fleet logs or reports. The settings check that the link settings agree
(``FleetSettings``' validator), so this module reads the settings and the settings never import it.

``link_error`` turns what a client raised into a ``LinkRefused`` (not retriable) when the server rejected the
credentials or the TLS handshake failed, naming the service, the address and the setting to check.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fleet.errors import ConfigError, LinkRefused

if TYPE_CHECKING:
    from fleet.settings import FleetSettings

MAX_SECRET_BYTES = 64 * 1024
_AUTH_MARKERS = (
    "authorization violation",
    "authentication",
    "wrongpass",
    "noauth",
    "invalid username-password",
    "sasl",
    "scram",
    "user is disabled",
    "noperm",
    "permissions violation",
)


def read_secret(path: Path, what: str) -> str:
    """The secret in ``path`` (surrounding whitespace stripped); ``ConfigError`` naming the file, never its text."""
    try:
        raw = path.read_bytes()[: MAX_SECRET_BYTES + 1]
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_SECRET_BYTES:
        raise ConfigError(f"the {what} file {path} is over {MAX_SECRET_BYTES} bytes; is it the right file?")
    try:
        secret = raw.decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"the {what} file {path} is not UTF-8 text") from None
    if not secret:
        raise ConfigError(f"the {what} file {path} is empty")
    return secret


def tls_context(ca_file: Path | None, cert_file: Path | None, key_file: Path | None, what: str) -> ssl.SSLContext:
    """A client TLS context that verifies the server (against ``ca_file``, else the system CAs) and its hostname,
    with an optional client certificate for mutual TLS; ``ConfigError`` naming a file that cannot be loaded."""
    try:
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the {what} CA file {ca_file}: {_reason(exc)}") from None
    if cert_file is not None:
        try:
            context.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"cannot load the {what} client certificate {cert_file} (key {key_file}): {_reason(exc)}"
            ) from None
    return context


def nats_options(settings: FleetSettings) -> dict[str, Any]:
    """The nats-py ``connect`` keywords for credentials and TLS (empty when neither is configured)."""
    options: dict[str, Any] = {}
    if settings.nats_creds_file is not None:
        _readable(settings.nats_creds_file, "NATS credentials")
        options["user_credentials"] = str(settings.nats_creds_file)
    if settings.nats_nkey_seed_file is not None:
        options["nkeys_seed_str"] = read_secret(settings.nats_nkey_seed_file, "NATS NKey seed")
    if settings.nats_user is not None and settings.nats_password_file is not None:
        options["user"] = settings.nats_user
        options["password"] = read_secret(settings.nats_password_file, "NATS password")
    if urlsplit(settings.broker_url.split(",")[0].strip()).scheme == "tls":
        options["tls"] = tls_context(
            settings.nats_tls_ca_file, settings.nats_tls_cert_file, settings.nats_tls_key_file, "NATS"
        )
    return options


def kafka_options(settings: FleetSettings) -> dict[str, Any]:
    """The aiokafka client keywords (producer, consumers and admin alike) for SASL and SSL."""
    tls = settings.kafka_tls or settings.kafka_tls_ca_file is not None
    sasl = settings.kafka_sasl_mechanism is not None
    if not tls and not sasl:
        return {}
    options: dict[str, Any] = {"security_protocol": ("SASL_" if sasl else "") + ("SSL" if tls else "PLAINTEXT")}
    if tls:
        options["ssl_context"] = tls_context(
            settings.kafka_tls_ca_file, settings.kafka_tls_cert_file, settings.kafka_tls_key_file, "Kafka"
        )
    if sasl:
        assert settings.kafka_password_file is not None  # checked with the settings
        options["sasl_mechanism"] = settings.kafka_sasl_mechanism
        options["sasl_plain_username"] = settings.kafka_user
        options["sasl_plain_password"] = read_secret(settings.kafka_password_file, "Kafka password")
    return options


def redis_options(settings: FleetSettings) -> dict[str, Any]:
    """The redis-py client keywords for an ACL user and TLS (``rediss://``); they override the URL's own."""
    options: dict[str, Any] = {}
    if settings.redis_password_file is not None:
        options["password"] = read_secret(settings.redis_password_file, "Redis password")
        if settings.redis_user is not None:
            options["username"] = settings.redis_user
    if urlsplit(settings.store_url).scheme in ("rediss", "rediss+cluster"):
        for name, path in (
            ("ssl_ca_certs", settings.redis_tls_ca_file),
            ("ssl_certfile", settings.redis_tls_cert_file),
            ("ssl_keyfile", settings.redis_tls_key_file),
        ):
            if path is not None:
                options[name] = str(_readable(path, f"Redis TLS {name.removeprefix('ssl_')}"))
        options["ssl_cert_reqs"] = "required"
        options["ssl_check_hostname"] = True
    return options


_TLS_SCHEMES = frozenset({"tls", "rediss", "rediss+cluster"})
# how a TLS server that refuses the client may end the handshake, depending on timing (TLS 1.3)
_CLOSED_IN_HANDSHAKE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, ssl.SSLEOFError)


def link_error(service: str, target: str, exc: BaseException, setting: str) -> LinkRefused | None:
    """A ``LinkRefused`` when ``exc`` (or what caused it) is a rejected login or a failed TLS handshake, else None.

    Args:
        service: ``"NATS"``, ``"Kafka"`` or ``"Redis"``.
        target: the (redacted) address.
        setting: the settings to check, named in the message (``"FLEET_REDIS_USER / FLEET_REDIS_PASSWORD_FILE"``).
    """
    for cause in _chain(exc):
        if isinstance(cause, ssl.SSLError | ssl.CertificateError) and not isinstance(cause, ssl.SSLEOFError):
            reason = _reason(cause)
            if "ALERT" in reason.upper():  # the server sent the alert: it refused our (missing) certificate
                hint = (
                    f"check FLEET_{service.upper()}_TLS_CERT_FILE and _KEY_FILE (the server wants a client certificate)"
                )
                return LinkRefused(service, target, "the server refused the TLS client", reason, hint)
            return LinkRefused(service, target, "the TLS handshake failed", reason, _tls_hint(service))
    secured = target.split("://", 1)[0].lower() in _TLS_SCHEMES
    for cause in _chain(exc):
        if secured and isinstance(cause, _CLOSED_IN_HANDSHAKE):
            # TLS 1.3: a server that refuses the client's (missing) certificate may reset the link instead of
            # sending an alert the client gets to read, depending on timing
            hint = f"check FLEET_{service.upper()}_TLS_CERT_FILE and _KEY_FILE (the server may want a client cert)"
            reason = f"the connection was closed during the TLS handshake ({type(cause).__name__})"
            return LinkRefused(service, target, "the server refused the TLS client", reason, hint)
        text = f"{type(cause).__name__}: {cause}"
        lowered = text.lower()
        if "certificate_verify_failed" in lowered or "wrong version number" in lowered:
            return LinkRefused(service, target, "the TLS handshake failed", _short(text), _tls_hint(service))
        if any(marker in lowered for marker in _AUTH_MARKERS):
            return LinkRefused(service, target, "the server refused the credentials", _short(text), f"check {setting}")
    return None


def _tls_hint(service: str) -> str:
    kind = service.lower()
    return f"check FLEET_{kind.upper()}_TLS_CA_FILE (the CA that signed the server's certificate) and the host name"


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(getattr(exc, "verify_message", None) or exc.reason)
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _readable(path: Path, what: str) -> Path:
    try:
        with path.open("rb"):
            return path
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
