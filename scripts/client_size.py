"""The client install, measured: build the wheel, install it with its base dependencies only into a fresh venv
under a temporary folder, and print its installed size.

    python scripts/client_size.py [--keep DIR]

Checks, in that venv, that ``from fleet import FleetClient, FleetSyncClient`` and ``fleet --help`` work, that the
client commands run (``fleet schemas export``), that none of torch, transformers, fastapi, uvicorn, faiss,
kubernetes, nats or numpy is installed, and that a server command says in one line which extra it needs. Exits 1
when a check fails or the install is 50 MB or more. Packages come from uv's cache, else the package index.
``tests/test_client_install.py`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MB = 50.0
ABSENT = ("torch", "transformers", "fastapi", "uvicorn", "faiss", "kubernetes", "nats", "aiokafka", "numpy")


def uv() -> str:
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.exists() else "uv"


def tree_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e6


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("FLEET_")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, **kwargs)  # type: ignore[call-overload, no-any-return]


def measure(work: Path) -> dict[str, object]:
    """Build, install and check the client in ``work``; the figures and what each check found."""
    dist = work / "dist"
    built = run([uv(), "build", "--wheel", "--quiet", "--out-dir", str(dist), str(ROOT)])
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("fleet_inference-*.whl")
    venv = work / "venv"
    made = run([uv(), "venv", "--quiet", "--python", sys.executable, str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = run([uv(), "pip", "install", "--quiet", "--python", str(python), str(wheel)])
    assert installed.returncode == 0, installed.stderr
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    frozen = run([uv(), "pip", "freeze", "--python", str(python)]).stdout.split()
    sdk = run([str(python), "-c", "from fleet import FleetClient, FleetSyncClient; print('ok')"], cwd=work)
    helped = run([str(venv / "bin" / "fleet"), "--help"], cwd=work)
    exported = run([str(venv / "bin" / "fleet"), "schemas", "export", str(work / "schemas")], cwd=work)
    probe = f"import importlib.util, json; print(json.dumps([m for m in {ABSENT!r} if importlib.util.find_spec(m)]))"
    present = json.loads(run([str(python), "-c", probe], cwd=work).stdout)
    gateway = run(
        [str(venv / "bin" / "fleet"), "gateway", "--broker", "nats://127.0.0.1:1", "--store", "redis://127.0.0.1:1"],
        cwd=work,
    )
    return {
        "installed_mb": round(tree_mb(site), 1),
        "venv_mb": round(tree_mb(venv), 1),
        "wheel_kb": round(wheel.stat().st_size / 1e3),
        "packages": len(frozen),
        "sdk_imports": sdk.returncode == 0 and sdk.stdout.strip() == "ok",
        "help_works": helped.returncode == 0 and "Usage" in helped.stdout,
        "schemas_export_works": exported.returncode == 0 and any((work / "schemas").glob("*.json")),
        "heavy_installed": present,
        "gateway_answer": gateway.stderr.strip(),
        "gateway_exit": gateway.returncode,
        "errors": "\n".join(r.stderr[-2000:] for r in (sdk, helped, exported) if r.returncode),
    }


def problems(figures: dict[str, object]) -> list[str]:
    found = []
    if float(figures["installed_mb"]) >= LIMIT_MB:  # type: ignore[arg-type]
        found.append(f"the client install is {figures['installed_mb']} MB, not under {LIMIT_MB:.0f} MB")
    for check in ("sdk_imports", "help_works", "schemas_export_works"):
        if not figures[check]:
            found.append(f"{check} failed: {figures['errors']}")
    if figures["heavy_installed"]:
        found.append(f"installed with the client: {figures['heavy_installed']}")
    answer = str(figures["gateway_answer"])
    if figures["gateway_exit"] != 1 or len(answer.splitlines()) != 1 or "fleet-inference[gateway]" not in answer:
        found.append(f"fleet gateway without the gateway extra answered ({figures['gateway_exit']}): {answer}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="build and install here (kept) instead of a temporary folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleet-client-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        figures = measure(work)
    print(
        f"client install (pip install fleet-inference): {figures['installed_mb']} MB in site-packages "
        f"({figures['packages']} packages; the venv {figures['venv_mb']} MB; the wheel {figures['wheel_kb']} kB); "
        f"limit {LIMIT_MB:.0f} MB"
    )
    found = problems(figures)
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
