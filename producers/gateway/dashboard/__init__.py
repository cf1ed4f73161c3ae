"""``/dashboard``: the operator dashboard, a static page served from assets shipped inside this package.

The page (``static/index.html`` and its plain JavaScript modules under ``static/js``) reads one live stream,
``/v1/operator/stream``, and calls the documented REST endpoints for every control. Its charting (uPlot) and graph
(Mermaid) libraries are vendored, pinned, under ``static/vendor`` with their licences (``scripts/vendor_ui.sh``
re-fetches them and checks their sha256), so the page works air-gapped: it loads nothing from another host, and its
Content-Security-Policy says so to the browser.

The page itself holds no data: whether an operator token is needed is asked of ``GET /v1/operator/access`` by
the page, which then shows its login form; every request for data carries the token. A gateway whose operator
surface is off (bound to a non-loopback address without ``FLEET_OPERATOR_TOKEN``) answers ``/dashboard`` with 403
and the reason instead of the page.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from fleet.producers.gateway.access import OperatorGate, operator_gate

STATIC_DIR = Path(__file__).parent / "static"
DASHBOARD_PATH = "/dashboard"
ASSETS_PATH = f"{DASHBOARD_PATH}/static"

# Everything from this origin; inline styles because uPlot and Mermaid size and colour their SVG and canvas inline.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "font-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

OFF_PAGE = "<!doctype html><title>Fleet dashboard: off</title><h1>The operator dashboard is off</h1><p>{reason}</p>"

router = APIRouter(include_in_schema=False)


@router.get(DASHBOARD_PATH)
async def dashboard(gate: OperatorGate = Depends(operator_gate)) -> Response:
    reason = gate.disabled_reason
    if reason is not None:
        page = OFF_PAGE.format(reason=escape(reason))
        return HTMLResponse(page, status_code=403, headers=PAGE_HEADERS)
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get(f"{DASHBOARD_PATH}/")
async def dashboard_slash() -> RedirectResponse:
    return RedirectResponse(DASHBOARD_PATH)


def static_files() -> StaticFiles:
    """The page's assets, mounted at ``ASSETS_PATH``."""
    return StaticFiles(directory=STATIC_DIR)
