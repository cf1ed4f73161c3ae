"""``/docs`` (Swagger UI) and ``/redoc`` served from assets installed with Fleet, so they work air-gapped.

FastAPI's own pages load their JavaScript, CSS and favicon from a CDN and ReDoc adds Google Fonts; on a cluster
without internet access they render blank. The ``fastapi-offline`` package ships Swagger UI
(``swagger-ui-bundle.js``, ``swagger-ui.css``), ReDoc (``redoc.standalone.js``) and a favicon; the gateway serves
that folder under ``DOCS_ASSETS_PATH`` and points both pages at it.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_ASSETS_PATH = "/docs-assets"
ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"
OAUTH2_REDIRECT_PATH = "/docs/oauth2-redirect"


def _asset(request: Request, name: str) -> str:
    return f"{request.scope.get('root_path', '')}{DOCS_ASSETS_PATH}/{name}"


def install_docs(app: FastAPI) -> None:
    """Serve ``/docs``, its OAuth2 redirect and ``/redoc`` from ``ASSETS_DIR`` (create the app with
    ``docs_url=None, redoc_url=None`` so FastAPI's CDN pages are not registered as well)."""
    app.mount(DOCS_ASSETS_PATH, StaticFiles(directory=ASSETS_DIR), name="docs-assets")

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT_PATH}",
            swagger_js_url=_asset(request, "swagger-ui-bundle.js"),
            swagger_css_url=_asset(request, "swagger-ui.css"),
            swagger_favicon_url=_asset(request, "favicon.png"),
        )

    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=_asset(request, "redoc.standalone.js"),
            redoc_favicon_url=_asset(request, "favicon.png"),
            with_google_fonts=False,
        )

    app.add_api_route("/docs", swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route(OAUTH2_REDIRECT_PATH, oauth2_redirect, methods=["GET"], include_in_schema=False)
    app.add_api_route("/redoc", redoc, methods=["GET"], include_in_schema=False)
