"""A property test of job bodies: Hypothesis builds request bodies from a grammar of nasty shapes and sends them to a
real ``fleet gateway`` process (NATS + Redis, one ``echo`` worker process) on ``POST /v1/jobs``, ``POST
/v1/infer`` and as ``/v1/ws`` subscribe frames.

The shapes: nesting up to 1,200 deep, integers of up to 6,000 digits, NaN / Infinity / 1e400, lone surrogates,
odd unicode, strings of up to 300,000 characters, wrong types where the body names a model, an input or a job id,
duplicate keys, and garbage bytes. Each answer must be a 4xx or a success, never a 5xx; a success of ``/v1/infer``
must give back the input exactly as Python's own parser reads it (numbers and strings survive or are refused,
never changed); a WebSocket frame gets a frame back, or a close frame with a reason, never a dropped socket.

Meanwhile a separate process polls ``/healthz`` on its own connection (a poll every few milliseconds). No poll may
take ``HARD_LIMIT_S``, and none may take ``HEALTHZ_BUDGET_S`` because of a request: a poll over the budget
names the requests sent while it waited, and each is sent again ``REPLAYS`` times with the poller still running.
A request that blocks the gateway's event loop blocks it every time; one that does not was only there while the
machine was busy (a shared 2-core machine deschedules the gateway for 100-300 ms now and then), and the poll is
not counted. A poll is not counted either when the poller itself was not scheduled on time just before it (its
own short sleep overshot by ``STARVED_S``). Examples are bounded and derandomised, the Hypothesis database is off.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.processes import fleet_process, wait_http_ready
from tests.services import free_port

MAX_EXAMPLES = 60
HEALTHZ_BUDGET_S = 0.1
HARD_LIMIT_S = 2.0
STARVED_S = 0.05
REPLAYS = 3
MODEL = "echo"

POLLER = r"""
import sys, time
import httpx
url, out, sleep_s = sys.argv[1], sys.argv[2], 0.005
with httpx.Client(timeout=30) as client, open(out, "w", buffering=1) as samples:  # a line per poll
    while True:
        before = time.monotonic()
        time.sleep(sleep_s)
        started = time.monotonic()
        try:
            ok = client.get(url).status_code == 200
        except httpx.HTTPError:
            ok = False
        samples.write(f"{started} {time.monotonic() - started} {started - before - sleep_s} {int(ok)}\n")
"""


# -- the grammar ----------------------------------------------------------------------------------------------
def _float_text(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return repr(value)


def _deep(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


_STRING = st.one_of(
    st.text(max_size=20).map(json.dumps),
    st.text(st.characters(codec=None, exclude_categories=[]), max_size=10).map(json.dumps),  # surrogates included
    st.sampled_from(['"\\ud800x"', '"\\udfff"', '"x\\ud83d"', '"\\u0000"', '"\\ud83d\\ude00"', '"\\u202e"']),
    st.integers(10_000, 300_000).map(lambda n: json.dumps("x" * n)),
)
_SCALAR = st.one_of(
    st.integers(1, 6_000).map(lambda n: "-" * (n % 2) + "9" * n),
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(_float_text),
    st.sampled_from(["1e400", "-1e400", "1e-400", "-0", "0.0e0", "NaN", "Infinity", "-Infinity", "true", "null"]),
    _STRING,
    st.integers(0, 1_200).map(_deep),
)


def _object(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    members = st.lists(st.tuples(_STRING, children), max_size=4)
    return members.map(lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}")


def _extend(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.lists(children, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
        _object(children),
        st.tuples(children, children).map(lambda ab: f'{{"d":{ab[0]},"d":{ab[1]}}}'),  # a duplicate key
    )


JSON_TEXT = st.recursive(_SCALAR, _extend, max_leaves=8)
INPUT_TEXT = st.one_of(_object(JSON_TEXT), JSON_TEXT)  # an object mostly, any value (a wrong type) sometimes
MODEL_TEXT = st.one_of(st.just(json.dumps(MODEL)), st.sampled_from(['"nope"', "5", "null", '["echo"]']), _STRING)
JOB_ID_TEXT = st.one_of(st.text(max_size=30).map(json.dumps), _SCALAR)


@st.composite
def job_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["job", "job", "job", "any", "garbage"]))
    if kind == "garbage":
        return draw(st.binary(max_size=2_000))
    if kind == "any":
        return draw(JSON_TEXT).encode("utf-8", "surrogatepass")
    fields = [f'"model":{draw(MODEL_TEXT)}', f'"input":{draw(INPUT_TEXT)}']
    if draw(st.booleans()):
        fields.append(f'"job_id":{draw(JOB_ID_TEXT)}')
    if draw(st.booleans()):
        fields.append(f'"input":{draw(INPUT_TEXT)}')  # the key twice
    return ("{" + ",".join(fields) + "}").encode("utf-8", "surrogatepass")


@st.composite
def frames(draw: st.DrawFn) -> str | bytes:
    kind = draw(st.sampled_from(["subscribe", "subscribe", "any", "garbage"]))
    if kind == "garbage":
        return draw(st.binary(max_size=500))
    if kind == "any":
        return draw(JSON_TEXT)
    return '{"subscribe":[' + ",".join(draw(st.lists(JOB_ID_TEXT, min_size=1, max_size=3))) + "]}"


# -- the gateway ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet(redis_url: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The base URL of a gateway with an echo worker (real processes), and a folder for the test's files."""
    tmp = tmp_path_factory.mktemp("body-fuzz")
    env = {
        "FLEET_BROKER_URL": nats_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_MODELS": MODEL,
        "FLEET_LOG_LEVEL": "WARNING",
        "FLEET_MAX_BODY_BYTES": str(1 << 20),
    }
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with (
        fleet_process("gateway", "--port", str(port), env=env, log=tmp / "gateway.log") as gateway,
        fleet_process("worker", "--model", MODEL, env=env, log=tmp / "worker.log"),
    ):
        wait_http_ready(f"{base}/readyz", gateway, tmp / "gateway.log")
        yield {"base": base, "tmp": tmp}


@contextlib.contextmanager
def healthz_poller(base: str, samples: Path) -> Iterator[None]:
    """A separate process polling ``/healthz`` on its own connection, a line per poll in ``samples``."""
    poller = subprocess.Popen([sys.executable, "-c", POLLER, f"{base}/healthz", str(samples)])
    try:
        deadline = time.monotonic() + 30
        while not (samples.exists() and samples.read_text().count("\n") >= 2):  # started, connection open
            assert poller.poll() is None and time.monotonic() < deadline, "the /healthz poller did not start"
            time.sleep(0.05)
        yield
    finally:
        poller.kill()
        poller.wait(10)


@dataclass(frozen=True)
class Sent:
    """One request of the fuzz, with when it was sent and answered (``time.monotonic``: the poller's clock too)."""

    kind: str  # "/v1/jobs", "/v1/infer?wait=20" or "ws"
    data: str | bytes
    started: float
    ended: float
    status: int | None  # the HTTP status (None: a WebSocket, or a failed check)


@dataclass(frozen=True)
class Poll:
    at: float
    latency_s: float
    starved_s: float
    ok: bool


def read_polls(samples: Path) -> list[Poll]:
    polls = []
    for line in samples.read_text().splitlines():
        at, latency, starved, ok = line.split()
        polls.append(Poll(float(at), float(latency), float(starved), ok == "1"))
    return polls


def polls_since(samples: Path, moment: float, timeout_s: float = 10) -> list[Poll]:
    """The polls, once one has started after ``moment`` (so every poll that overlapped it has ended)."""
    deadline = time.monotonic() + timeout_s
    while not (polls := read_polls(samples)) or polls[-1].at <= moment:
        assert time.monotonic() < deadline, "the /healthz poller stopped"
        time.sleep(0.01)
    return polls


def send(client: httpx.Client, base: str, kind: str, data: str | bytes, log: list[Sent]) -> None:
    started, status = time.monotonic(), None
    try:
        if kind == "ws":
            _check_ws(base, data)
        else:
            assert isinstance(data, bytes)
            status = _check_http(client, kind, data)
    finally:
        log.append(Sent(kind, data, started, time.monotonic(), status))


def _check_http(client: httpx.Client, path: str, body: bytes) -> int:
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code < 500, (path, body[:300], response.status_code, response.text[:500])
    if path.startswith("/v1/infer") and response.status_code == 200:
        sent = json.loads(body)["input"]  # the last "input" wins, as in every parser here
        got = json.loads(response.content)["output"]
        assert got == sent, ("the output is not the input as sent", body[:300], response.text[:300])
    return response.status_code


def _check_ws(base: str, frame: str | bytes) -> None:
    with ws_connect(base.replace("http", "ws", 1) + "/v1/ws", open_timeout=10, close_timeout=5) as ws:
        ws.send(frame)
        try:
            answer = json.loads(ws.recv(timeout=10))
        except ConnectionClosed as exc:
            assert exc.rcvd is not None and exc.rcvd.reason, ("closed without a close frame or reason", frame)
            return
        assert answer["type"] in ("error", "result"), answer
        if answer["type"] == "error":
            assert not answer["error"]["type"].startswith("internal"), answer


def slow_polls(polls: list[Poll]) -> list[Poll]:
    """The polls over the budget while the poller itself ran on time."""
    return [p for p in polls if p.latency_s >= HEALTHZ_BUDGET_S and p.starved_s < STARVED_S]


def blocking(client: httpx.Client, base: str, sent: list[Sent], samples: Path) -> list[tuple[Sent, list[float]]]:
    """The requests that made ``/healthz`` wait past the budget each time they were sent again."""
    suspects: dict[tuple[str, str | bytes], Sent] = {}
    for poll in slow_polls(read_polls(samples)):
        for item in sent:
            if item.started < poll.at + poll.latency_s and item.ended > poll.at:
                suspects.setdefault((item.kind, item.data), item)
    confirmed = []
    for item in suspects.values():
        worst = []
        for _ in range(REPLAYS):
            replay: list[Sent] = []
            send(client, base, item.kind, item.data, replay)
            polls = polls_since(samples, replay[0].ended)
            during = [p for p in polls if p.at < replay[0].ended and p.at + p.latency_s > replay[0].started]
            worst.append(max((p.latency_s for p in during), default=0.0))
        if all(w >= HEALTHZ_BUDGET_S for w in worst):
            confirmed.append((item, worst))
    return confirmed


FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.generate),  # no shrinking: a failure reports its example within the time limit
)


def test_nasty_bodies_and_frames_get_a_4xx_or_a_success_and_healthz_stays_quick(fleet: dict[str, Any]) -> None:
    base, samples = fleet["base"], fleet["tmp"] / "healthz.txt"
    sent: list[Sent] = []
    with httpx.Client(base_url=base, timeout=30) as client, healthz_poller(base, samples):

        @FUZZ
        @given(body=job_bodies(), frame=frames())
        def check(body: bytes, frame: str | bytes) -> None:
            send(client, base, "/v1/jobs", body, sent)
            send(client, base, "/v1/infer?wait=20", body, sent)
            send(client, base, "ws", frame, sent)

        check()
        confirmed = blocking(client, base, sent, samples)
        polls = read_polls(samples)
    statuses = {item.status for item in sent if item.status is not None}
    assert {202, 200} <= statuses and {400, 422} <= statuses, f"the grammar missed a kind of answer: {statuses}"
    assert all(p.ok for p in polls), "a /healthz poll failed"
    assert len(polls) > 100, f"too few /healthz polls ({len(polls)})"
    worst = max(p.latency_s for p in polls if p.starved_s < STARVED_S)
    assert worst < HARD_LIMIT_S, f"/healthz took {worst * 1000:.0f} ms at worst"
    described = [(item.kind, repr(item.data[:200]), [f"{w * 1000:.0f} ms" for w in ws]) for item, ws in confirmed]
    assert not confirmed, f"requests that hold /healthz past {HEALTHZ_BUDGET_S * 1000:.0f} ms every time: {described}"
