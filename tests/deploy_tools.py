"""The tools that the deploy tests need, fetched on first use and cached under ``~/.cache/fleet`` (no skips).

* **helm** is built from its Go module, ``helm.sh/helm/v3/cmd/helm@HELM_VERSION``, with this machine's Go toolchain
  through the Go module proxy (``go install``), and cached as ``~/.cache/fleet/helm-<version>/helm``.
  ``FLEET_TEST_HELM=/path/to/helm`` uses a helm 3 that is already installed instead.
* **KEDA** is the Go module ``github.com/kedacore/keda/v2@KEDA_VERSION`` (``go mod download``). Its ScaledObject
  CRD (the OpenAPI schema the KEDA API server extension validates against) and the sources of the two scalers Fleet
  uses, whose struct tags declare the trigger metadata keys, are copied to ``~/.cache/fleet/keda-<version>/``.
* **Kubernetes JSON schemas** come with the ``kubernetes-validate`` package, a test dependency.

The first run needs the Go module proxy (1 to 4 minutes to build helm on 2 cores); later runs use the cache. A lock
guards parallel first runs. Anything that fails raises ``ServiceUnavailable`` with the reason and what to do.
``python -m tests.deploy_tools`` fetches both ahead of a test run.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fleet.errors import ServiceUnavailable

log = logging.getLogger(__name__)

HELM_MODULE = "helm.sh/helm/v3"
HELM_VERSION = "v3.22.0"
HELM_KUBE_MINOR = "37"  # helm v3.22 is built on the Kubernetes 1.37 client libraries (k8s.io/client-go v0.37)
KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_VERSION = "v2.21.0"
KEDA_CRD = "config/crd/bases/keda.sh_scaledobjects.yaml"
KEDA_SCALERS = ("pkg/scalers/nats_jetstream_scaler.go", "pkg/scalers/kafka_scaler.go")
GO_TIMEOUT_S = 900.0
# A test that fetches on a cold machine needs this long (pyproject's per-test timeout is for cached runs).
FETCH_TIMEOUT_S = 2 * GO_TIMEOUT_S
GO_HINT = (
    "Go 1.24 or newer must be on PATH (the project's machines have it in /usr/local/go/bin) and the Go module proxy "
    "reachable on the first run; or set FLEET_TEST_HELM=/path/to/helm to use an installed helm 3."
)


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fleet"


def _go() -> str:
    found = shutil.which("go") or next((p for p in ("/usr/local/go/bin/go",) if Path(p).exists()), None)
    if found is None:
        raise ServiceUnavailable("the Go toolchain (to fetch helm and KEDA)", GO_HINT)
    return found


def _run_go(argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
    started = time.monotonic()
    log.warning("fetching %s with '%s' (first run only; cached under %s)", what, " ".join(argv), cache_root())
    with tempfile.TemporaryDirectory(prefix="fleet-go-") as outside_any_module:
        try:
            proc = subprocess.run(
                argv,
                cwd=outside_any_module,
                env={**os.environ, **(env or {})},
                capture_output=True,
                text=True,
                timeout=GO_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServiceUnavailable(what, f"'{' '.join(argv)}' took more than {GO_TIMEOUT_S}s. {GO_HINT}") from exc
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise ServiceUnavailable(
            what, f"'{' '.join(argv)}' failed (exit {proc.returncode}). {GO_HINT} Go said:\n{tail}"
        )
    log.warning("fetched %s in %.1fs", what, time.monotonic() - started)
    return proc.stdout


def _cached(root: Path, fill: Any) -> Path:
    """``root`` once ``fill(root)`` has completed there (under a lock, so parallel first runs fetch once)."""
    done = root / ".complete"
    if done.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            fill(root)
            done.touch()
    return root


def cached() -> bool:
    """True when helm and the KEDA files are already here, so nothing will be fetched."""
    helm_ready = bool(os.environ.get("FLEET_TEST_HELM")) or (cache_root() / f"helm-{HELM_VERSION}/.complete").exists()
    return helm_ready and (cache_root() / f"keda-{KEDA_VERSION}/.complete").exists()


def helm() -> str:
    """Path to a helm 3 binary: FLEET_TEST_HELM, or the pinned version built once with ``go install`` and cached."""
    given = os.environ.get("FLEET_TEST_HELM")
    if given:
        if not os.access(given, os.X_OK):
            raise ServiceUnavailable("helm", f"FLEET_TEST_HELM={given} is not an executable file")
        return given
    return str(_cached(cache_root() / f"helm-{HELM_VERSION}", _build_helm) / "helm")


def _build_helm(root: Path) -> None:
    # The ldflags of helm's own release build: its version, and the Kubernetes version of its client libraries as
    # the default for .Capabilities (without them a source build claims Kubernetes 1.20).
    flags = [f"{HELM_MODULE}/internal/version.version={HELM_VERSION}"]
    for package in ("pkg/chartutil", "pkg/lint/rules"):
        flags += [
            f"{HELM_MODULE}/{package}.k8sVersionMajor=1",
            f"{HELM_MODULE}/{package}.k8sVersionMinor={HELM_KUBE_MINOR}",
        ]
    ldflags = " ".join(["-s", "-w", *(f"-X {flag}" for flag in flags)])
    argv = [_go(), "install", "-trimpath", "-ldflags", ldflags, f"{HELM_MODULE}/cmd/helm@{HELM_VERSION}"]
    _run_go(argv, f"helm {HELM_VERSION}", env={"GOBIN": str(root), "CGO_ENABLED": "0"})
    if not (root / "helm").exists():
        raise ServiceUnavailable("helm", f"'go install' succeeded but left no helm binary in {root}. {GO_HINT}")


@dataclass(frozen=True, slots=True)
class Keda:
    """The files of the pinned KEDA release that the tests read."""

    root: Path

    @property
    def scaledobject_crd(self) -> dict[str, Any]:
        crd: dict[str, Any] = yaml.safe_load((self.root / Path(KEDA_CRD).name).read_text())
        return crd

    def scaler_source(self, name: str) -> str:
        """The Go source of ``pkg/scalers/<name>`` (e.g. ``kafka_scaler.go``)."""
        return (self.root / name).read_text()


def keda() -> Keda:
    """The ScaledObject CRD and scaler sources of KEDA_VERSION, from its Go module (downloaded once, cached)."""
    return Keda(_cached(cache_root() / f"keda-{KEDA_VERSION}", _fetch_keda))


def _fetch_keda(root: Path) -> None:
    out = _run_go([_go(), "mod", "download", "-json", f"{KEDA_MODULE}@{KEDA_VERSION}"], f"KEDA {KEDA_VERSION}")
    module = Path(json.loads(out)["Dir"])
    for relative in (KEDA_CRD, *KEDA_SCALERS):
        source = module / relative
        if not source.exists():
            raise ServiceUnavailable("KEDA", f"{KEDA_MODULE}@{KEDA_VERSION} has no {relative}")
        shutil.copyfile(source, root / source.name)


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    """Run helm with ``args``; the caller checks the exit status."""
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120, check=False)


def helm_template(chart: Path, *args: str, kube_version: str) -> subprocess.CompletedProcess[str]:
    """``helm template`` of ``chart`` as release ``fleet-test`` in namespace ``fleet-ns``."""
    return run_helm(
        "template", "fleet-test", str(chart), "--namespace", "fleet-ns", "--kube-version", kube_version, *args
    )


if __name__ == "__main__":  # fetch ahead of a test run: python -m tests.deploy_tools
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(helm())
    print(keda().root)
