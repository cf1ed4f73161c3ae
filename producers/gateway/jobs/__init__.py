"""Jobs: submit, read and long-poll, cancel (``routes``); run one in a request (``infer``); push the result over a
WebSocket (``ws``) or server-sent events (``sse``); the queue bound of each model (``backlog``) and the sweep that
publishes jobs a crashed gateway left unpublished (``reconcile``).
"""
