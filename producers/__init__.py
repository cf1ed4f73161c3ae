"""Producers: the REST + WebSocket gateway (``fleet.producers.gateway``), the async client SDK
(``fleet.producers.sdk``) and
its synchronous twin (``fleet.producers.sdk_sync``).

The gateway validates requests, answers from its result caches (L1 / L2 / L3) or records them in the result store
and publishes them to the broker at their priority, answers ``/v1/infer`` in one request, runs DAGs, and serves
the operator dashboard and API; the SDK (aiohttp, ``fleet.producers.sdk_http``) is the Python client of the gateway's
HTTP and WebSocket API.
"""
