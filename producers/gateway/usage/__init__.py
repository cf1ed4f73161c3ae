"""Usage: ``GET /v1/usage``, device-seconds and their cost per tenant, model, version and device kind
(``report``: the pure grouping and pricing; ``routes``: the query's checks, tenant isolation and the store read)."""
