"""A model's versions side by side: the pure cores of traffic splitting, output comparison, promotion and circuit
breaking. Each module is a set of pure functions over small immutable records: no I/O, no clock, no
asyncio; the caller passes in the time and the random draws, and keeps the returned state.

- ``traffic``: a model's traffic policy (primary, canary with a weight, shadow with a mirror share, sticky keys)
  and ``route``, which picks the version that answers a request and the shadow version that also computes it.
- ``compare``: per-runtime agreement between a primary's and a shadow's output (cosine similarity, top-label
  agreement, span F1, top-1 agreement, exact equality), each a number in 0..1.
- ``controller``: the promotion / rollback controller, ``decide(state, observation, config, now_s)``: steps a
  canary's weight up while its error rate, p99 and shadow agreement stay within limits of the primary's, promotes
  it at the last step and rolls it back at once on a breach; a manual promote or rollback is an override in state.
- ``breaker``: a circuit breaker per (model, version) or (worker, model): closed, open, half-open, with a growing
  cool-down and a ``Retry-After`` for the 503.

The I/O shells come later: nothing here is wired into the gateway, the dispatcher or the workers yet (see
docs/explanation/rollouts.md).
"""
