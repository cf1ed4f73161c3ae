"""Fleet's container image for the tests: built by ``scripts/image/build.sh`` (cached by content; ``make test``
builds it before the suite, so a test only checks the cache) and run with podman as the test's own containers.

``image_ref`` builds (or finds) a variant and returns its reference; a machine without buildah or podman fails
with the command that installs them. ``container`` runs one detached (``--network host``: it reaches the test's
NATS and Redis on 127.0.0.1, and the test reaches its ports), yields its name and removes it by name at the end;
``podman`` runs a podman command with the settings the build uses (``podman_env``: ``scripts/image/env.sh``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from fleet.errors import ServiceUnavailable

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "scripts" / "image" / "build.sh"
BUILD_TIMEOUT_S = 1200  # a cold build: the base (a minute) and a 6 GB dependency layer (minutes)
TOOLS = ("buildah", "podman", "runc", "mmdebstrap")
ENV_SCRIPT = ROOT / "scripts" / "image" / "env.sh"


@functools.cache
def podman_env() -> dict[str, str]:
    """The environment scripts/image/env.sh gives buildah and podman (the config file, the storage driver)."""
    proc = subprocess.run(
        ["bash", "-c", f'source "{ENV_SCRIPT}" && env -0'], capture_output=True, text=True, timeout=30, check=True
    )
    return dict(item.split("=", 1) for item in proc.stdout.split("\0") if "=" in item)


def image_ref(variant: str = "cpu", *options: str) -> str:
    """The image of ``variant`` (``cpu`` or ``cuda``), built now unless the cache has this content; ``options``:
    more of build.sh's (``--repository DIR``, ``--name NAME``)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise ServiceUnavailable("the container tools", f"{', '.join(missing)} missing: run scripts/services.sh")
    try:
        proc = subprocess.run(
            ["bash", str(BUILD), "--variant", variant, *options],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise ServiceUnavailable("fleet image", f"{BUILD} did not finish within {BUILD_TIMEOUT_S}s") from exc
    if proc.returncode != 0:
        raise ServiceUnavailable("fleet image", f"{BUILD} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def podman(*args: str, timeout_s: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s, env=podman_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


@contextlib.contextmanager
def container(image: str, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``image`` running ``fleet ARGS`` in the background; yields the container's name."""
    name = f"fleet-test-{uuid.uuid4().hex[:12]}"
    flags = [f"--env={key}={value}" for key, value in (env or {}).items()]
    # the health check runs when asked (podman healthcheck run), not on a systemd timer this machine lacks
    podman("run", "--detach", "--name", name, "--network", "host", "--health-interval", "disable", *flags, image, *args)
    try:
        yield name
    finally:
        podman("rm", "--force", "--time", "5", name, check=False, timeout_s=60)


def docker_config(image: str) -> dict[str, Any]:
    """The image's Docker-format config (its ``Healthcheck`` among the rest: podman's inspect leaves it out)."""
    proc = subprocess.run(
        ["buildah", "inspect", "--type", "image", image],
        capture_output=True, text=True, timeout=60, env=podman_env(), check=True,
    )  # fmt: skip
    return dict(json.loads(proc.stdout)["Docker"]["config"])


def logs(name: str) -> str:
    return podman("logs", name, check=False).stdout[-4000:]


def wait_http(url: str, name: str, timeout_s: float = 90) -> None:
    """Wait until ``url`` answers 200; fail with the container's log when it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        state = podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.strip()
        if state not in ("running", "created", "configured"):
            raise AssertionError(f"container {name} is {state or 'gone'}:\n{logs(name)}")
        time.sleep(0.3)
    raise AssertionError(f"{url} not ready within {timeout_s}s:\n{logs(name)}")
