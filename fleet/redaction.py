"""Secrets out of URLs: ``redact`` for every URL Fleet logs or reports, ``url_has_secret`` for the CLI's refusal of a
password in a flag.

A leaf (the standard library only), so that the settings, the CLI and every client can use it without importing
the link builders of ``fleet.links``.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SECRET_QUERY_KEYS = frozenset({"password", "token", "sasl_plain_password"})


def redact(url: str) -> str:
    """``url`` with any password, token or secret query value replaced by ``***`` (for messages and logs).

    Several comma-separated servers (``nats://a:4222,nats://b:4222``) are redacted one by one.
    """
    if "," in url:
        return ",".join(redact(part) for part in url.split(","))
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "(unparsable URL)"
    netloc = parts.netloc
    if "@" not in netloc and not any(key.lower() in SECRET_QUERY_KEYS for key, _ in parse_qsl(parts.query)):
        return url  # nothing to hide: the URL as written (urlunsplit would turn memory:// into memory:)
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0] if password is not None else ""
        netloc = f"{user}:***@{host}" if user else f"***@{host}"
    query = parts.query
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(key.lower() in SECRET_QUERY_KEYS for key, _ in pairs):
        query = urlencode([(k, "***" if k.lower() in SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def url_has_secret(url: str) -> bool:
    """True when ``url`` carries a password, a token or a secret query value (what ``redact`` would hide)."""
    return redact(url) != url
