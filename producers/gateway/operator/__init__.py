"""The operator surface: the dashboard's live feed (``feed``) built from worker beats (``beats``) and scaling
decisions put in words (``words``); the operator API (``routes``: snapshot, stream, recent jobs), scaling controls
(``scaling``), draining a worker (``workers``), dead letters (``deadletters``, recorded by ``deadletter_recorder``,
redriven by ``redrive``).
"""
