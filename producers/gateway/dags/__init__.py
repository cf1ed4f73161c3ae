"""DAG workflows over HTTP: register specs and start, show and cancel runs (``routes``); follow a run step by step
over a WebSocket or server-sent events (``events``).
"""
