"""Fleet: an event-driven ML inference fleet.

The kernel package: settings, constants, errors, the broker and result-store seams and their implementations,
telemetry and the ``fleet`` CLI. Components (producers, consumers, dispatcher, autoscaler, dags) depend on this
package and on ``schemas``; only ``fleet.cli`` (the composition root) imports components.
"""

__version__ = "0.1.0"
