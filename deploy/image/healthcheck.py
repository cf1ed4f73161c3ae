#!/usr/bin/python3
"""The image's HEALTHCHECK: GET ``FLEET_HEALTH_URL`` (default ``http://127.0.0.1:8000/healthz``, the gateway of
``fleet up`` / ``fleet gateway``; a worker serves ``/healthz`` on its ``--metrics-port``, a dispatcher on its
``--port``) and exit 0 on a 2xx answer, 1 otherwise with one line on stderr. Standard library only, run by the
system Python, so it costs no import of Fleet.
"""

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/healthz"
TIMEOUT_S = 4.0


def main() -> int:
    url = os.environ.get("FLEET_HEALTH_URL") or DEFAULT_URL
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if 200 <= status < 300:
        return 0
    print(f"unhealthy: {url} answered {status}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
