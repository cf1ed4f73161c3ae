"""The versions of one model a worker serves, and a batch grouped by the version each job asks for. Pure.

A worker of ``name@v`` serves only ``v``; a worker of an unpinned repository ``name`` serves every version its
repository holds (read when a job asks for a version other than the default, so a version added later is served
without a restart); a built-in or a handler class serves its spec's one version. A job that names no version gets
the worker's default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet.consumers.handlers.base import ModelHandler
from fleet.consumers.requests import Job
from fleet.schemas.jobs import JobError

HandlerFactory = Callable[[str], ModelHandler[Any, Any]]


@dataclass(frozen=True, slots=True)
class ServedVersions:
    """What a worker of model ``name`` serves.

    Attributes:
        name: the model name (its subjects).
        default: the version of a job that names none.
        make: a constructed, not yet loaded, handler of a version (the pool loads it).
        listed: the versions there are, read when asked (an unpinned repository model's); None: only ``default``.
    """

    name: str
    default: str
    make: HandlerFactory
    listed: Callable[[], list[str]] | None = None

    def serves(self, version: str) -> bool:
        return version == self.default or (self.listed is not None and version in self.listed())

    def described(self) -> str:
        versions = self.listed() if self.listed is not None else [self.default]
        return ", ".join(versions) or self.default

    def unserved(self, version: str) -> JobError:
        return JobError(
            type="unserved_version",
            message=f"model {self.name!r} has no version {version!r} on this worker; it serves version(s) "
            f"{self.described()}",
            retriable=False,
        )


def by_version(jobs: list[Job], default: str) -> dict[str, list[Job]]:
    """The jobs of a batch by the version each asks for (``default`` for none), in the order versions first appear."""
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        asked = job.request.version if job.request is not None else None
        groups.setdefault(asked or default, []).append(job)
    return groups
