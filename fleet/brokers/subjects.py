"""Pure helpers on subjects and group names, shared by the broker implementations.

Subjects use NATS dot notation. ``listen`` patterns may use NATS wildcards: ``*`` matches exactly one token and
``>`` (last token only) matches one or more tokens. Durable subscriptions (``subscribe``) take literal subjects.
"""

from __future__ import annotations

from fleet import constants as c
from fleet.errors import ConfigError

# JetStream stream for direct assignment (``fleet.inbox.<worker>``); next to REQ_STREAM/DLQ_STREAM in spirit.
INBOX_STREAM = "FLEET_INBOX"

# Which stream holds a subject: the longest matching prefix wins. Also the de-duplication scope.
STREAM_PREFIXES: tuple[tuple[str, str], ...] = (
    (c.REQ_PREFIX + ".", c.REQ_STREAM),
    (c.DLQ_PREFIX + ".", c.DLQ_STREAM),
    (c.INBOX_PREFIX + ".", INBOX_STREAM),
)

_FORBIDDEN_IN_TOKEN = frozenset(" \t\r\n")
_FORBIDDEN_IN_GROUP = frozenset(" \t\r\n.*>/\\")


def stream_for(subject: str) -> str | None:
    """The Fleet stream that stores ``subject``, or ``None`` when no stream does."""
    for prefix, stream in STREAM_PREFIXES:
        if subject.startswith(prefix):
            return stream
    return None


def check_subject(subject: str, *, wildcards: bool = False) -> str:
    """Return ``subject`` when it is well formed; raise ``ConfigError`` saying what is wrong otherwise."""
    tokens = subject.split(".")
    for i, token in enumerate(tokens):
        if not token or _FORBIDDEN_IN_TOKEN.intersection(token):
            raise ConfigError(f"subject {subject!r} has an empty token or whitespace; use 'a.b.c' tokens")
        is_wildcard = token in ("*", ">")
        if is_wildcard and not wildcards:
            raise ConfigError(f"subject {subject!r} has a wildcard; durable subscriptions take literal subjects")
        if token == ">" and i != len(tokens) - 1:
            raise ConfigError(f"subject {subject!r}: '>' may only be the last token")
        if not is_wildcard and ("*" in token or ">" in token):
            raise ConfigError(f"subject {subject!r}: wildcards must be whole tokens")
    return subject


def check_group(group: str) -> str:
    """Return ``group`` when it can name a durable consumer group on every broker; raise ``ConfigError`` otherwise."""
    if not group or len(group) > 128 or _FORBIDDEN_IN_GROUP.intersection(group):
        raise ConfigError(
            f"group name {group!r} is not valid: use 1-128 characters without whitespace, '.', '*', '>' or slashes"
        )
    return group


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` matches the NATS ``pattern`` (``*`` one token, ``>`` one or more trailing tokens)."""
    want = pattern.split(".")
    have = subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(have) == len(want)
