"""The model repository: a folder of models with versions (``models/<name>/<version>/model.yaml`` and weights),
read by the gateway (schemas, no weights), the workers (verified weights) and ``fleet models``.

``entry`` is one version of one model; ``verify`` checks its files against the manifest's digests.
"""
