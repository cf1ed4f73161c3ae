"""Jobs: submit, read and long-poll, cancel (``routes``); run one in a request (``infer``); push the result over a
WebSocket (``ws``) or server-sent events (``sse``); the queue bound of each model (``backlog``) and the sweep that
publishes jobs a crashed gateway left unpublished (``reconcile``).

This package is the feature's public face: another feature that runs jobs (the OpenAI-compatible routes of
``fleet.producers.gateway.models``) submits and waits through the names here, never through its modules.
"""

from fleet.producers.gateway.jobs.infer import answer, default_wait_s, wait_for_end
from fleet.producers.gateway.jobs.routes import submit_body

__all__ = ["answer", "default_wait_s", "submit_body", "wait_for_end"]
