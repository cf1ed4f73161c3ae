"""Producers: the REST + WebSocket gateway (``producers.gateway``) and the async client SDK (``producers.sdk``).

The gateway validates requests, records them in the result store and publishes them to the broker, runs DAGs,
and serves the operator dashboard and API; the SDK (aiohttp, ``producers.sdk_http``) is the Python client of the
gateway's HTTP and WebSocket API.
"""
