"""Lag-based autoscaling (issue 5, not built yet). Its inputs exist already: ``Broker.lag`` and the
``fleet_queue_lag`` gauge (``fleet.lag``), and the per-worker throughput in heartbeats on
``fleet.ctl.heartbeat.<model>`` (``schemas.wire.Heartbeat``)."""
