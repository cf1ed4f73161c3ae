"""The REST + WebSocket gateway: submit, poll and push job results over HTTP, or run a job in one request
(``/v1/infer``); result caches (``cache``, ``cache_l3``, ``semantic_index``, ``embedder``); DAG runs; the operator
dashboard (``/dashboard``) and operator API (live feed, scaling controls, drain, dead letters).

``create_app(settings)`` builds the FastAPI application; see ``fleet.producers.gateway.app``.
"""

from fleet.producers.gateway.app import CacheParts, create_app
from fleet.producers.gateway.limits import GatewayLimits
from fleet.producers.gateway.state import GatewayState

__all__ = ["CacheParts", "GatewayLimits", "GatewayState", "create_app"]
