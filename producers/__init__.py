"""Producers: the REST + WebSocket gateway (``producers.gateway``) and the async client SDK (``producers.sdk``).

The gateway validates requests, records them in the result store and publishes them to the broker; the SDK is
the Python client of the gateway's HTTP and WebSocket API.
"""
