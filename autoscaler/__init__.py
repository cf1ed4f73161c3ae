"""Lag-based autoscaling: ``fleet.autoscaler.signals`` reads topic lag (``Broker.lag``) and worker heartbeats,
``fleet.autoscaler.policy`` is the pure scaling policy (lag or rate mode, bounds, stabilisation, activation 0 <-> 1),
``fleet.autoscaler.service`` runs it on an interval under a Redis lock (one acting autoscaler) with a decision log and
operator overrides, ``fleet.autoscaler.pools`` sums a pool's models' demand (the models one multi-model worker
serves, scaled as one), and ``fleet.autoscaler.backends`` drive replicas (local processes, in-process workers,
Kubernetes Deployments, dry run)."""
