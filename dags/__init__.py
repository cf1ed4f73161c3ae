"""DAG workflows chained through topics (not built yet): steps publish their outputs as the next step's requests,
fan-in joins in Redis under ``fleet:dag:<run>`` (``fleet.constants.dag_key``)."""
