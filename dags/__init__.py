"""DAG workflows chained through topics: the DSL, its pure core, and the runner that workers and the gateway use.

- ``fleet.dags.spec``: ``DagSpec`` / ``StepSpec`` and ``load_spec`` (YAML, JSON or a dict; size limits).
- ``fleet.dags.expressions``: ``${...}`` JMESPath expressions, what they read, their rendering into inputs.
- ``fleet.dags.validate``: ``validate(spec, models) -> CompiledDag`` or one ``fleet.errors.DagInvalid`` naming every
  problem's step and path.
- ``fleet.dags.state``: ``RunState``, JSON-friendly, deterministic job ids ``<run>.<step>.<index>.<key>`` (the key is
the
  run's secret, so no client can claim a step's id) and the per-tenant namespaces of DAG names and run ids.
- ``fleet.dags.evaluate``: what runs next, as pure functions of ``(CompiledDag, RunState)``: ``new_run``, ``advance``,
  ``apply_result``, ``cancel``, ``run_state``, ``run_view``.
- ``fleet.dags.graph``: nodes, edges and Mermaid text of a DAG.
- ``fleet.dags.limits``: what a spec, an expression and an evaluation may cost (depth, size, length, a budget of
values),
  checked before the parser or the interpreter goes deeper.

- ``fleet.dags.runner``: ``DagRunner`` registers specs, starts runs, continues them from a worker's settle hook
  (``on_settled``: one compare-and-set of the run's document under ``fleet:dag:<run>`` per settled job, then the
  successors are published before the ack), cancels and shows them. State lives in ``fleet.store.dagstore``.
- ``fleet.dags.starter``: ``DagStarter`` starts runs published on ``fleet.req._dagrun`` (no gateway needed).

Examples are in ``dags/examples/``.
"""
