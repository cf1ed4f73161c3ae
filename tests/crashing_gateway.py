"""``python -m tests.crashing_gateway gateway ARGS``: ``fleet gateway ARGS`` whose process dies (``os._exit``) right
after a submission wrote its ``queued`` record and before it publishes the request: the crash that the reconcile
sweep must repair. Test-only: nothing in Fleet itself has such a hook."""

from __future__ import annotations

import os
import sys
from typing import Any

from fleet.cli import main
from fleet.producers.gateway.jobs import routes as job_routes

EXIT_CODE = 86


async def _die_before_publishing(*args: Any, **kwargs: Any) -> None:
    os._exit(EXIT_CODE)


if __name__ == "__main__":
    job_routes._publish_new = _die_before_publishing  # type: ignore[assignment]
    sys.argv = ["fleet", *sys.argv[1:]]
    main()
