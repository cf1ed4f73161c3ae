"""A model's versions side by side: traffic splitting, output comparison, promotion and circuit breaking.

All but ``service`` are pure functions over small immutable records: no I/O, no clock, no asyncio; the caller
passes in the time and the random draws, and keeps the returned state.

- ``traffic``: a model's traffic policy (primary, canary with a weight, shadow with a mirror share, sticky keys)
  and ``route``, which picks the version that answers a request and the shadow version that also computes it.
- ``compare``: per-runtime agreement between a primary's and a shadow's output (cosine similarity, top-label
  agreement, span F1, top-1 agreement, exact equality), each a number in 0..1.
- ``controller``: the promotion / rollback controller, ``decide(state, observation, config, now_s)``: steps a
  canary's weight up while its error rate, p99 and shadow agreement stay within limits of the primary's, promotes
  it at the last step and rolls it back at once on a breach; a manual promote or rollback is an override in state.
- ``breaker``: a circuit breaker per (model, version) or (worker, model): closed, open, half-open, with a growing
  cool-down and a ``Retry-After`` for the 503.
- ``breaker_counts``: the same breaker judged from per-version counts (a failure streak and totals) rather than
  one outcome at a time, as the controller sees them.
- ``service``: the rollout controller's loop (one per Redis, under a lock; run by ``fleet up`` and ``fleet
  autoscaler``): each tick it reads every model's policy document and measurements from ``fleet.store.rollouts``,
  calls ``controller.decide`` and ``breaker_counts.judge``, and writes changes back by compare-and-set, with a line
  on the model's timeline.

Around them: the gateway routes by the policy (``fleet.producers.gateway.policies``), the workers' settle hook
counts outcomes and compares shadows (``fleet.consumers.version_outcomes``); see docs/explanation/rollouts.md.
"""
