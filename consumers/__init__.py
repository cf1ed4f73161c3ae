"""The worker side of Fleet: the worker loop, the micro-batcher and the model handlers.

A worker pulls micro-batches of requests for one or more models from the broker (every priority level, higher
first: ``fleet.brokers.prioritized``), sized by count and cost budget (``fleet.consumers.batcher``) and, for a model
with a p99 target, by the batch-size controller (``fleet.consumers.batch_control``), runs each batch through a
``fleet.consumers.handlers.base.ModelHandler`` on one device (``fleet.consumers.device``), writes every job's terminal
record to the result store and only then acks (``fleet.consumers.settle``, with the DAG continuation and the
per-version outcome counts, ``fleet.consumers.version_outcomes``, as settle hooks). An operator's drain
(``fleet.consumers.drain``) runs the same graceful stop as SIGTERM.

Several models and versions in one process share a model pool within a memory budget (``fleet.consumers.pool``:
loads on demand, least-recently-used eviction); ``--replicas N`` computes N batches at once on one copy of the
weights (``fleet.consumers.replicas``); a worker whose batches keep failing opens its breaker and takes no work
until a probe succeeds (``fleet.consumers.breaker``).
"""
