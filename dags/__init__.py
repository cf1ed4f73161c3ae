"""DAG workflows: the DSL and its pure core (no I/O yet).

- ``dags.spec``: ``DagSpec`` / ``StepSpec`` and ``load_spec`` (YAML, JSON or a dict; size limits).
- ``dags.expressions``: ``${...}`` JMESPath expressions, what they read, their rendering into inputs.
- ``dags.validate``: ``validate(spec, models) -> CompiledDag`` or one ``fleet.errors.DagInvalid`` naming every
  problem's step and path.
- ``dags.state``: ``RunState``, JSON-friendly, and deterministic job ids ``<run>.<step>.<index>``.
- ``dags.evaluate``: what runs next, as pure functions of ``(CompiledDag, RunState)``: ``new_run``, ``advance``,
  ``apply_result``, ``cancel``, ``run_state``, ``run_view``.
- ``dags.graph``: nodes, edges and Mermaid text of a DAG.

Still to come: runs chained through topics by the workers' settle hook, fan-in state under ``fleet:dag:<run>``
(``fleet.constants.dag_key``) changed by one atomic script per settled step, the API and the CLI. Examples are in
``dags/examples/``.
"""
