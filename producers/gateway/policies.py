"""The request path's view of the models' traffic policies: which version answers a job, which one shadows it, and
whether a version's circuit breaker lets it through.

Each gateway keeps the ``RolloutDoc`` of every served model that has one (``fleet.store.rollouts``) in a dict that a
background task refreshes every ``refresh_s`` (one ``SMEMBERS`` and one ``GET`` per model with a policy), so a
request reads no Redis for it: a model without a policy costs one dict lookup and is routed exactly as before (no
version on the message; the worker's default answers). A refresh that fails (Redis away) keeps the last documents
and logs once until it succeeds again: requests are never failed for it. A change made through this gateway's API
is put into its dict at once (``put``, ``drop``); other gateways see it within ``refresh_s``.

The versions a policy names are resolved to their specs when the policy is first seen (``fleet.models
.resolve_version``: the repository, else the manifests workers published per version), so the input is validated
and the cache keyed by the version that answers. A version that cannot be resolved is logged and not routed to: its
canary share goes to the primary, a primary that cannot be resolved leaves the model on its plain route.

Choosing (``choose``): a job that names ``name@version`` bypasses the split (that version, no arm); otherwise
``fleet.lifecycle.traffic.route`` splits by the policy with this process's random numbers (an independent draw for
the shadow). Then the chosen version's breaker (``fleet.lifecycle.breaker``, states written by the controller):

- closed: go;
- open within its cool-down: a canary falls back to the primary (logged, the record says primary), a primary or an
  explicit version is refused with ``503 circuit_open`` and ``Retry-After``;
- past its cool-down or half-open: ``breaker.allow`` decides whether this request is a probe, and the state it
  returns is written back by compare-and-set on the document's revision (a lost race reads again, three tries), so
  gateways together let only ``half_open_probes`` requests through at a time. A store that fails here refuses the
  request as an open breaker would: a probe nobody can account for is not sent.

A shadow is mirrored only while its own breaker is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from fleet.errors import ConfigError, FleetError, UnknownModel, UnservedVersion
from fleet.lifecycle import breaker
from fleet.lifecycle.traffic import TrafficPolicy, request_key, route
from fleet.models import resolve_version
from fleet.producers.gateway.errors import ApiError
from fleet.producers.gateway.metrics import BREAKER_TURNED
from fleet.repository.layout import Repository
from fleet.schemas.jobs import Arm
from fleet.schemas.models import ModelSpec
from fleet.store.manifests import ManifestStore
from fleet.store.rollouts import RolloutDoc, RolloutStore

logger = logging.getLogger(__name__)

REFRESH_S = 1.0
CAS_TRIES = 3
FALLBACK_LOG_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class Choice:
    """Where one job goes: the spec of the version that answers (its input schema and cache salt), the version and
    arm written on the message and record (None, None: the plain route), and the shadow's spec, if mirrored."""

    spec: ModelSpec
    version: str | None = None
    arm: Arm | None = None
    shadow: ModelSpec | None = None
    reason: str = "no traffic policy"


def circuit_open(model: str, version: str, state: breaker.BreakerState, retry_after: str) -> ApiError:
    """The 503 of a version whose breaker refuses the request."""
    return ApiError(
        503,
        "circuit_open",
        f"model {model!r} version {version!r} is failing and its circuit breaker is {state.status.replace('_', '-')} "
        f"({state.reason}); retry after {retry_after}s",
        {"model": model, "version": version, "breaker": state.status, "retry_after_s": int(retry_after)},
        headers={"Retry-After": retry_after},
    )


class TrafficPolicies:
    """The traffic policies of a gateway's served models, cached (see the module docstring). ``async with`` runs
    the refresher."""

    def __init__(
        self,
        rollouts: RolloutStore,
        manifests: ManifestStore,
        repository: Repository | None,
        specs: Mapping[str, ModelSpec],
        *,
        refresh_s: float = REFRESH_S,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.rollouts, self.manifests, self.repository = rollouts, manifests, repository
        self.specs = specs
        self.refresh_s = refresh_s
        self._draw = draw
        self._docs: dict[str, RolloutDoc] = {}
        self._versions: dict[tuple[str, str], ModelSpec] = {}
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._fallback_logged: dict[str, float] = {}
        self._touched: dict[str, float] = {}  # model -> when this process last put or dropped its document

    async def __aenter__(self) -> TrafficPolicies:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop(), name="traffic-policies")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- the cache --------------------------------------------------------------------------------------------
    def doc(self, model: str) -> RolloutDoc | None:
        """The cached document of ``model`` (None: no policy, as far as this gateway knows)."""
        return self._docs.get(model)

    async def put(self, doc: RolloutDoc) -> None:
        """Take a document this process just wrote (or read) as the current one; resolves its versions."""
        await self._know_versions(doc.model, doc.policy)
        self._docs[doc.model] = doc
        self._touched[doc.model] = time.monotonic()

    def drop(self, model: str) -> None:
        self._docs.pop(model, None)
        self._touched[model] = time.monotonic()

    async def refresh(self) -> None:
        """Read the documents of the served models that have one; a failure keeps the last ones (logged once). A
        model this process changed (``put``, ``drop``) since the read began keeps what it changed to: the read may
        predate the change."""
        started = time.monotonic()
        try:
            named = set(await self.rollouts.models())
            docs = {}
            for model in sorted(named & set(self.specs)):
                doc = await self.rollouts.read(model)
                if doc is not None:
                    await self._know_versions(model, doc.policy)
                    docs[model] = doc
        except FleetError as exc:
            if not self._failing:
                logger.warning("traffic policies: cannot refresh (%s); routing by the last known ones", exc.message)
            self._failing = True
            return
        if self._failing:
            logger.info("traffic policies: refreshed again")
        self._failing = False
        for model, at in self._touched.items():
            if at >= started:
                current = self._docs.get(model)
                if current is None:
                    docs.pop(model, None)
                else:
                    docs[model] = current
        self._docs = docs

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # a bug: log it, keep the cache, try again next time
                logger.exception("traffic policies: refresh failed")

    # -- versions ---------------------------------------------------------------------------------------------
    async def spec_of(self, name: str, version: str) -> ModelSpec:
        """The spec of ``name@version``: the served one, a known one, or resolved now (``resolve_version``).

        Raises:
            UnknownModel: ``name`` is not served here.
            ConfigError: no such version (the message names the known ones).
        """
        served = self.specs.get(name)
        if served is None:
            raise UnknownModel(name, list(self.specs))
        if served.version == version:
            return served
        known = self._versions.get((name, version))
        if known is None:
            known = await resolve_version(name, version, self.repository, self.manifests)
            if known.name != name:  # a built-in or handler spec served under the entry's name
                known = replace(known, name=name, version=version)
            self._versions[(name, version)] = known
        return known

    def known_spec(self, name: str, version: str) -> ModelSpec | None:
        served = self.specs.get(name)
        if served is not None and served.version == version:
            return served
        return self._versions.get((name, version))

    async def _know_versions(self, model: str, policy: TrafficPolicy) -> None:
        for version in filter(None, (policy.primary, policy.canary, policy.shadow)):
            try:
                await self.spec_of(model, version)
            except (ConfigError, UnknownModel) as exc:
                logger.warning("traffic policy of %s: version %s is not routed to: %s", model, version, exc.message)

    # -- choosing ---------------------------------------------------------------------------------------------
    def explicit(self, name: str, version: str) -> ModelSpec:
        """The spec a job naming ``name@version`` runs: the served version or one a policy named.

        Raises:
            UnservedVersion: neither (404 ``unknown_model``).
        """
        doc = self._docs.get(name)
        named = doc is not None and version in (doc.policy.primary, doc.policy.canary, doc.policy.shadow)
        spec = self.known_spec(name, version)
        if spec is None or (spec is not self.specs[name] and not named):
            raise UnservedVersion(name, version, self.specs[name].version)
        return spec

    async def choose(
        self,
        spec: ModelSpec,
        version: str | None,
        tenant: str | None,
        fields: Mapping[str, Any],
        headers: Mapping[str, str],
    ) -> Choice:
        """Where a job of served model ``spec`` goes (``version``: the one it names explicitly, else None).

        Raises:
            ApiError: 503 ``circuit_open`` (with ``Retry-After``) when the version that must answer is refused by
                its breaker.
        """
        doc = self._docs.get(spec.name)
        if version is not None:
            chosen = self.explicit(spec.name, version)
            if doc is not None:
                await self._admit_or_refuse(doc, version)
            return Choice(chosen, version, None, None, f"the job names version {version}")
        if doc is None:
            return Choice(spec)
        policy = doc.policy
        primary = self.known_spec(spec.name, policy.primary)
        if primary is None:
            return Choice(spec, reason=f"primary {policy.primary} is not resolved here: plain route")
        sticky = request_key(policy.sticky, tenant, fields, headers)
        routing = route(policy, sticky, self._draw(), model=spec.name, shadow_draw=self._draw())
        chosen_version, arm, reason = routing.version, routing.arm, routing.reason
        resolved = self.known_spec(spec.name, chosen_version)
        chosen = resolved if resolved is not None else primary
        if resolved is None:
            chosen_version, arm = policy.primary, "primary"
            reason = f"{reason}; canary not resolved here: primary {policy.primary}"
        if arm == "canary" and not await self._admit(doc, chosen_version):
            BREAKER_TURNED.labels(spec.name, chosen_version, "fallback").inc()
            self._log_fallback(spec.name, chosen_version, policy.primary)
            chosen_version, arm, chosen = policy.primary, "primary", primary
            reason = f"{reason}; canary's circuit is open: primary {policy.primary}"
        if arm == "primary":
            await self._admit_or_refuse(doc, chosen_version)
        shadow = self._shadow(doc, routing.shadow_version)
        return Choice(chosen, chosen_version, arm, shadow, reason)

    def _shadow(self, doc: RolloutDoc, version: str | None) -> ModelSpec | None:
        if version is None:
            return None
        state = doc.breakers.get(version)
        if state is not None and state.status != "closed":
            return None
        return self.known_spec(doc.model, version)

    async def _admit_or_refuse(self, doc: RolloutDoc, version: str) -> None:
        if not await self._admit(doc, version):
            BREAKER_TURNED.labels(doc.model, version, "refused").inc()
            latest = self._docs.get(doc.model, doc)
            state = latest.breakers.get(version, breaker.BreakerState())
            retry_after = breaker.retry_after_header(state, latest.breaker, time.time())
            raise circuit_open(doc.model, version, state, retry_after)

    async def _admit(self, doc: RolloutDoc, version: str) -> bool:
        """Whether ``version``'s breaker lets this request through; a probe's place is written back (CAS)."""
        state = doc.breakers.get(version)
        if state is None or state.status == "closed":
            return True
        allowed, after = breaker.allow(state, doc.breaker, time.time())
        if after == state:
            return allowed
        return await self._probe(doc.model, version)

    async def _probe(self, model: str, version: str) -> bool:
        try:
            for _ in range(CAS_TRIES):
                doc = await self.rollouts.read(model)
                if doc is None:
                    self.drop(model)
                    return True  # the policy was removed meanwhile: the plain route has no breaker here
                state = doc.breakers.get(version, breaker.BreakerState())
                allowed, after = breaker.allow(state, doc.breaker, time.time())
                if after == state:
                    self._docs[model], self._touched[model] = doc, time.monotonic()
                    return allowed
                written = doc.model_copy(update={"breakers": {**doc.breakers, version: after}})
                if await self.rollouts.write(written, doc.revision):
                    self._docs[model] = written.model_copy(update={"revision": doc.revision + 1})
                    self._touched[model] = time.monotonic()
                    if allowed:
                        BREAKER_TURNED.labels(model, version, "probe").inc()
                    return allowed
        except FleetError as exc:
            logger.warning("breaker of %s@%s: cannot account for a probe (%s); refusing", model, version, exc.message)
            return False
        logger.warning("breaker of %s@%s: %d writers raced for a probe; refusing this one", model, version, CAS_TRIES)
        return False

    def _log_fallback(self, model: str, canary: str, primary: str) -> None:
        now = time.monotonic()
        if now - self._fallback_logged.get(model, -FALLBACK_LOG_EVERY_S) >= FALLBACK_LOG_EVERY_S:
            self._fallback_logged[model] = now
            logger.info(
                "model %s: canary %s's circuit is open; its share goes to primary %s (logged every %gs)",
                model,
                canary,
                primary,
                FALLBACK_LOG_EVERY_S,
            )
