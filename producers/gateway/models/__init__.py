"""Models: the OpenAI-compatible routes and the rerank route, on top of ordinary jobs.

* ``listing``: ``GET /v1/models`` and ``GET /v1/models/{model}``, OpenAI's list of models with Fleet's schemas;
* ``embeddings``: ``POST /v1/embeddings``, OpenAI's request and response, one or more jobs of an embeddings model;
* ``rerank``: ``POST /v1/rerank`` in TEI's or Cohere's shape, jobs of a rerank model;
* ``kinds``: which served models the routes take (from their input and output schemas, no weights);
* ``runner``: the requests' jobs, submitted and awaited through the jobs feature's public face, so priorities,
  caches, tenants, API keys, rate limits, quotas and metrics apply as for ``POST /v1/infer``;
* ``traffic``: ``/v1/models/{name}/traffic`` (operator): a model's traffic policy between its versions (canary,
  sticky A/B, shadow), and ``/v1/models/{name}/comparisons``: the shadow outputs compared with the answers;
* ``openai_errors``: errors in OpenAI's shape on these routes (the rest of the API keeps its own).
"""
