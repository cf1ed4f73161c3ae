"""The dashboard page as the gateway serves it, without a browser: every asset it names is served from this
origin, every asset ships in the wheel (package-data), the vendored libraries are the pinned ones, and a gateway
whose operator surface is off refuses the page and says why. The page in a real browser: test_operator_dashboard."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import re
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from fleet.producers.gateway import create_app
from fleet.producers.gateway.dashboard import STATIC_DIR
from fleet.settings import FleetSettings
from tests.gateway_helpers import FAST_LIMITS, model_refs

ROOT = Path(__file__).resolve().parent.parent
ASSET = re.compile(r'(?:src|href)="(/[^"]+)"')
IMPORT = re.compile(r'from "\./([^"]+)"')
PIN = re.compile(r'"\S+\s+package/\S+\s+(\S+)\s+([0-9a-f]{64})"')


@contextlib.asynccontextmanager
async def gateway(unique: str, **values: Any) -> AsyncIterator[httpx.AsyncClient]:
    refs, _ = model_refs(unique, "echo")
    app = create_app(FleetSettings(models=refs, **values), limits=FAST_LIMITS)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client


async def test_the_page_and_every_asset_it_names_are_served_from_this_origin(unique: str) -> None:
    async with gateway(unique, host="127.0.0.1") as client:
        page = await client.get("/dashboard")
        assert page.status_code == 200, page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        names = ASSET.findall(page.text)
        modules = [p for p in STATIC_DIR.glob("js/*.js")]
        names += [f"/dashboard/static/js/{m}" for js in modules for m in IMPORT.findall(js.read_text())]
        names += ["/dashboard/static/vendor/mermaid/mermaid.min.js"]  # loaded by dag.js when a run is opened
        assert any(n.endswith("main.js") for n in names) and any(n.endswith("uPlot.iife.min.js") for n in names)
        for name in names:
            assert (await client.get(name)).status_code == 200, name
        assert (await client.get("/dashboard/")).headers["location"] == "/dashboard"


async def test_a_gateway_bound_elsewhere_without_a_token_refuses_the_page_and_says_why(unique: str) -> None:
    async with gateway(unique, host="0.0.0.0", auth="off") as client:
        page = await client.get("/dashboard")
        assert page.status_code == 403
        assert "FLEET_OPERATOR_TOKEN" in page.text and "0.0.0.0" in page.text


async def test_with_a_token_the_page_loads_and_asks_for_it(unique: str) -> None:
    async with gateway(unique, host="0.0.0.0", operator_token="t0ken", auth="off") as client:
        page = await client.get("/dashboard")
        assert page.status_code == 200
        assert 'id="login-form"' in page.text
        access = (await client.get("/v1/operator/access")).json()
        assert access == {"token_required": True, "enabled": True, "reason": None, "auth": "off"}


def test_every_static_file_ships_in_the_wheel() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["fleet.producers.gateway.dashboard"]
    files = [p.relative_to(STATIC_DIR.parent).as_posix() for p in STATIC_DIR.rglob("*") if p.is_file()]
    assert files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
    assert missing == [], f"not in [tool.setuptools.package-data]: {missing}"


def test_the_vendored_libraries_are_the_pinned_ones_with_their_licences() -> None:
    pins = PIN.findall((ROOT / "scripts" / "vendor_ui.sh").read_text())
    assert {Path(target).name for target, _ in pins} >= {"uPlot.iife.min.js", "uPlot.min.css", "mermaid.min.js"}
    assert sum(Path(target).name == "LICENSE" for target, _ in pins) == 2
    for target, sha256 in pins:
        shipped = STATIC_DIR / "vendor" / target
        assert hashlib.sha256(shipped.read_bytes()).hexdigest() == sha256, target
    vendored = {p.relative_to(STATIC_DIR / "vendor").as_posix() for p in (STATIC_DIR / "vendor").rglob("*.*")}
    assert vendored <= {target for target, _ in pins} | {"uplot/LICENSE", "mermaid/LICENSE"}
