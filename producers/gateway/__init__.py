"""The REST + WebSocket gateway, a thin core around one folder per feature:

* ``jobs``: submit, poll and push job results over HTTP (long-poll, WebSocket, server-sent events), or run a job in
  one request (``/v1/infer``);
* ``access``: API keys, roles, the operator gate, per-tenant rate limits and quotas, the audit log;
* ``cache``: the result caches (L1, L2, L3 semantic);
* ``operator``: the operator dashboard's feed and the operator API (scaling controls, drain, dead letters);
* ``dags``: DAG runs;
* ``models``: the OpenAI-compatible routes (``/v1/embeddings``, ``/v1/models``) and ``/v1/rerank``.

The core: the app and its lifespan (``app``), the state the handlers share (``state``), errors, limits, metrics,
calls into the broker and store (``calls``), push framing (``push``), the ops routes (``ops``), the API docs
(``docs``, ``openapi_doc``) and the dashboard's page (``dashboard``). A feature imports the core and its own
modules, and another feature only through that feature's package (checked by ``tests/test_imports.py``).

``create_app(settings)`` builds the FastAPI application; see ``fleet.producers.gateway.app``.
"""

from fleet.producers.gateway.app import CacheParts, create_app
from fleet.producers.gateway.limits import GatewayLimits
from fleet.producers.gateway.state import GatewayState

__all__ = ["CacheParts", "GatewayLimits", "GatewayState", "create_app"]
