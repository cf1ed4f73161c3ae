"""Models for the pods of the deploy tests, importable inside Fleet's image (``tests/kube_kubelet.py`` mounts this
file into each container at ``/opt/plugins``): it imports nothing but ``fleet``.

``kube_handlers:sleep_<token>`` is the built-in sleep handler as model ``sleep-<token>``, so each test has a model
(and subjects) of its own; the chart's ``handler`` value names it.
"""

from __future__ import annotations

from typing import Any

from fleet.consumers.handlers import ModelHandler, with_name
from fleet.consumers.handlers.sleep import SleepHandler


def __getattr__(name: str) -> type[ModelHandler[Any, Any]]:
    base, sep, token = name.partition("_")
    if base == "sleep" and sep:
        return with_name(SleepHandler, f"sleep-{token}")
    raise AttributeError(name)
