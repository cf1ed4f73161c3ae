"""Direct assignment: ``fleet dispatcher`` holds each request of a model in ``dispatch`` routing until its result is
stored and assigns it to a worker's inbox (``fleet.inbox.<worker>``) by a load-balancing policy: JIQ idle queues
fed by workers' idle announcements, the amnesia list of recently active workers, and power-of-d, peak-EWMA and
JIQ with a shortest-expected-delay check for comparison (``fleet.dispatcher.policies``). ``fleet.dispatcher.state`` and
``fleet.dispatcher.roster`` hold the per-dispatcher worker state; ``fleet.dispatcher.sim_engine`` is the discrete-event
simulator (``fleet sim``) that runs the same policies, checked against queueing formulas in
``fleet.dispatcher.analytic``. ``fleet.dispatcher.affinity`` prefers a worker with the request's model version loaded
(multi-model workers), and ``fleet.dispatcher.sim_affinity`` simulates the cold loads it avoids."""
