"""Runs chained through topics: start a run, continue it from each settled job, cancel it, show it.

No orchestrator process: ``DagRunner.on_settled`` is a worker's settle hook (``fleet.consumers.settle``). When a DAG
job's terminal record is stored, the settling worker applies the result to the run's document with one atomic
compare-and-set (``fleet.store.dagstore``), lets the pure evaluator say what starts now (``fleet.dags.evaluate``), and
publishes those jobs before its own message is acked. A worker that dies in between leaves its message unacked;
the redelivery finds the job terminal, changes nothing in the run, and publishes every job of the run that is still
outstanding again (``evaluate.outstanding``): their ids are deterministic (``<run>.<step>.<index>``), so the broker
or the store drops a repeat. A step is launched once, because only the compare-and-set that moves it from
``pending`` wins; a join therefore fires once, whatever the order, the redeliveries and the number of workers.

When a run fails, is cancelled or expires, its outstanding jobs are cancelled in the store, so a worker that takes
one skips it, and pending steps are never started. A run that is over at its start (an empty ``for_each``, a
``when`` false for every step, a fan-out over the bound) is stored over, with its ``finished_at``: every waiter and
event stream answers at once.

Tenants: a DAG spec and a run belong to a tenant. Each tenant has its own namespace of DAG names and run ids
(``fleet.dags.state.scoped``: ``<tenant>:<name>`` in the store; the default tenant's are the bare names), so another
tenant's DAG or run id is, to a tenant, one that does not exist. A run's job ids carry its key
(``<run>.<step>.<index>.<key>``, ``fleet.dags.state.job_id``), which no client can guess or claim; a result whose job id
is not the one its run gives that step and index is ignored. A run started before keys (no ``key`` in its
document) keeps its bare id, its spec's bare name and its old job ids until it ends; ``store_id`` and ``spec_ref``
tell the two apart by the document, and the settle hook by the job id.

Parsing and validating a spec, and evaluating a run (its start, a settle's change, what is outstanding), run in a
thread, each pass within one budget of values (``fleet.dags.limits``), so neither a gateway's nor a worker's event loop
waits on an expression. A settle evaluates its change in a thread against the document as it reads it first;
``update_run`` then applies that result, or evaluates again (on the loop, within the budget) when the document
changed in between.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from fleet import constants as c
from fleet import tenancy, tracing
from fleet.brokers.base import Broker
from fleet.dags import evaluate, limits
from fleet.dags.spec import load_spec
from fleet.dags.state import SETTLED, RunState, check_run_id, has_key, job_id, new_key, scoped
from fleet.dags.validate import CompiledDag, validate
from fleet.errors import InvalidInput, RunIdTaken, StoreError, UnknownDag, UnknownRun
from fleet.schemas.jobs import JobError, JobRecord, JobState
from fleet.schemas.models import ModelSpec
from fleet.schemas.wire import DagContext, RequestMessage
from fleet.store.base import Finish, ResultStore
from fleet.store.dagstore import DagStore, RunDoc

__all__ = ["DagRunner", "UnknownDag", "UnknownRun"]  # the errors live in fleet.errors; imported here too

log = logging.getLogger(__name__)
PUBLISH_WINDOW = 256  # jobs of a run published at once (a fan-out of more goes out in windows of this many)


class DagRunner:
    """Starts and continues DAG runs over ``broker`` with their state in ``dags`` beside ``store``.

    Args:
        models: the models DAGs may use, for validation at registration (a worker passes what it knows; it only
            continues runs of DAGs that were validated when they were registered).
    """

    def __init__(
        self, broker: Broker, store: ResultStore, dags: DagStore, models: Mapping[str, ModelSpec] | None = None
    ) -> None:
        self.broker = broker
        self.store = store
        self.dags = dags
        self.models = dict(models or {})
        self._compiled: dict[tuple[str, int], CompiledDag] = {}
        self._joining: dict[str, list[tuple[DagContext, JobRecord, asyncio.Future[None]]]] = {}

    # -- specs ------------------------------------------------------------------------------------------------
    async def register(
        self, source: str | bytes | Mapping[str, Any], tenant: str | None = None
    ) -> tuple[str, int, CompiledDag]:
        """Validate and store a spec of ``tenant`` (None: the default tenant) in its namespace; raises
        ``DagInvalid`` naming every problem. The same spec again keeps its version."""
        spec, compiled = await asyncio.to_thread(_load_and_validate, source, self.models)
        ref = scoped(spec.name, tenant)
        version = await self.dags.register(ref, spec.model_dump(mode="json"))
        self._compiled[(ref, version)] = compiled
        return spec.name, version, compiled

    async def compiled(
        self, name: str, version: int | None = None, tenant: str | None = None
    ) -> tuple[int, CompiledDag]:
        """The compiled spec of ``tenant``'s DAG ``name`` at ``version`` (None: the latest; ``tenant`` None: the
        default tenant's, or ``name`` as the store names it, ``spec_ref``). Versions never change, so each is read
        and compiled once per process; the latest costs one small read to learn its number. ``UnknownDag`` names
        ``name`` as given: another tenant's DAG is one that does not exist."""
        ref = scoped(name, tenant)
        if version is None:
            version = await self.dags.latest_version(ref)
            if version is None:
                raise UnknownDag(name, None)
        if (ref, version) in self._compiled:
            return version, self._compiled[(ref, version)]
        found = await self.dags.spec(ref, version)
        if found is None:
            raise UnknownDag(name, version)
        chosen, raw = found
        if (ref, chosen) not in self._compiled:
            self._compiled[(ref, chosen)] = await asyncio.to_thread(_load_stored, raw, self.models)
        return chosen, self._compiled[(ref, chosen)]

    async def compiled_of(self, doc: RunDoc) -> CompiledDag:
        """The compiled spec a run runs."""
        return (await self.compiled(spec_ref(doc), doc["version"]))[1]

    # -- runs -------------------------------------------------------------------------------------------------
    async def start(
        self,
        name: str,
        run_input: Any,
        run_id: str | None = None,
        timeout_s: float | None = None,
        tenant: str | None = None,
        version: int | None = None,
    ) -> tuple[bool, RunDoc]:
        """Start a run of ``tenant``'s DAG ``name`` at ``version`` (None: the latest; ``tenant`` None: the default
        tenant; its steps' jobs carry it on the wire). Idempotent on ``run_id`` within the tenant: a second start
        returns the first run, and publishes what it has outstanding again, so a start whose publish was lost
        completes. Another tenant's run ids are not this tenant's: the same id starts a run of its own. (A run of
        another tenant started before run ids had namespaces, under the default tenant's bare id, raises
        ``RunIdTaken`` to the default tenant until it expires.)"""
        given = run_id is not None
        run_id = check_run_id(run_id) if run_id else uuid.uuid4().hex
        version, dag = await self.compiled(name, version, tenant)
        if dag.name != name:  # a store name (``<tenant>:<name>``) read as every tenant's: not a DAG to run
            raise UnknownDag(name, None)
        if given and tenancy.stored(tenant) is not None and (old := await self._legacy(run_id, tenant)) is not None:
            await self._publish_outstanding(old)
            return False, old
        key = new_key()
        state, over = await asyncio.to_thread(_first_state, dag, run_id, run_input, key)
        now = time.time()
        doc: RunDoc = {
            "run": state.to_dict(),
            "version": version,
            "key": key,
            "created_at": now,
            "deadline": now + timeout_s if timeout_s else None,
            "finished_at": None,
            "times": {},
        }
        if tenancy.stored(tenant) is not None:
            doc["tenant"] = tenancy.stored(tenant)
        _stamp(doc, None, state, now)
        if over:  # over at its start: nothing will settle it later
            doc["finished_at"] = now
        traced = tracing.active()
        if traced is None:
            created, doc = await self.dags.create_run(scoped(run_id, tenant), doc)
        else:  # the run is one trace: this span is its root (or a child of the caller's, e.g. the REST request's)
            with traced.span(f"run {name}", {"fleet.dag": name, "fleet.dag.run": run_id, "fleet.tenant": tenant or ""}):
                doc["traceparent"] = traced.current_traceparent()
                created, doc = await self.dags.create_run(scoped(run_id, tenant), doc)
        if not created and tenancy.owner(doc.get("tenant")) != tenancy.owner(tenant):
            raise RunIdTaken(run_id)  # only a run from before namespaces, under the default tenant's bare id
        await self._publish_outstanding(doc)
        return created, doc

    async def _legacy(self, run_id: str, tenant: str | None) -> RunDoc | None:
        """``tenant``'s run ``run_id`` from before run ids had namespaces (stored under the bare id, no key)."""
        doc = await self.dags.get_run(run_id)
        if doc is None or doc.get("key") or tenancy.owner(doc.get("tenant")) != tenancy.owner(tenant):
            return None
        return doc

    async def _find(self, run_id: str, viewer: str | None) -> RunDoc | None:
        """The run ``run_id`` of ``viewer`` (``ALL_TENANTS``: ``run_id`` is the store's id, ``store_id``)."""
        doc = await self.dags.get_run(scoped(run_id, viewer))
        if doc is None and tenancy.stored(viewer) is not None:
            doc = await self._legacy(run_id, viewer)
        if doc is None or not tenancy.visible(doc.get("tenant"), viewer):
            return None
        return doc

    async def on_settled(self, job: Any, record: JobRecord, won: bool) -> None:
        """The settle hook: continue the run of a DAG job whose terminal record is stored.

        The settler runs the hooks of a batch concurrently; the results of one run that settle together are applied
        in one compare-and-set of its document (the first hook applies them all; the others wait for it).
        """
        request: RequestMessage | None = getattr(job, "request", None)
        if request is None or request.dag is None:
            return
        ctx = request.dag
        keyed = has_key(request.job_id)  # a run with a key lives in its tenant's namespace; one from before, bare
        sid = scoped(ctx.run, request.tenant) if keyed else ctx.run
        ref = scoped(ctx.dag, request.tenant) if keyed else ctx.dag
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._joining.get(sid)
        if waiting is not None:
            waiting.append((ctx, record, future))
            await future
            return
        batch = self._joining[sid] = [(ctx, record, future)]
        try:
            await asyncio.sleep(0)  # the batch's other hooks for this run join now
        finally:
            del self._joining[sid]
        try:
            await self._continue(sid, ref, ctx, [(c, r) for c, r, _ in batch], job)
        except BaseException as exc:
            for _, _, other in batch[1:]:
                if not other.done():
                    other.set_exception(exc if isinstance(exc, Exception) else StoreError("continuation cancelled"))
            raise
        for _, _, other in batch[1:]:
            if not other.done():
                other.set_result(None)

    async def _continue(
        self, sid: str, ref: str, ctx: DagContext, results: list[tuple[DagContext, JobRecord]], job: Any = None
    ) -> None:
        _, dag = await self.compiled(ref, ctx.version)
        change = _Change(dag, results)
        current = await self.dags.get_run(sid)
        if current is not None:
            await asyncio.to_thread(change.prepare, current)
        try:
            before, after = await self.dags.update_run(sid, change)
        except StoreError:
            if await self.dags.get_run(sid) is None:  # the run expired: nothing to continue
                log.warning("%d jobs belong to DAG run %s, which no longer exists", len(results), ctx.run)
                return
            raise
        # A change publishes what it launched (the jobs it rendered). A result the run had already means a
        # redelivery: the settle that recorded it may have died before publishing, so everything the run has
        # outstanding goes out again.
        hop_started = _hop_started(results)
        traced = tracing.active()
        if traced is None or not (change.replayed or change.launches):
            await self._publish_next(before, after, change, hop_started)
        else:  # the hop: a child of the settled step's process span, parent of the next steps' publish spans
            parent = traced.parent_of(job, after.get("traceparent"))
            attributes = {"fleet.dag": ctx.dag, "fleet.dag.run": ctx.run, "fleet.dag.step": ctx.step}
            with traced.span(f"hop {ctx.dag}", attributes, parent=parent):
                await self._publish_next(before, after, change, hop_started)
        if after is not before and after.get("finished_at") is not None and before.get("finished_at") is None:
            await self._cancel_outstanding(dag, after)

    async def _publish_next(self, before: RunDoc, after: RunDoc, change: _Change, hop_started: float) -> None:
        if change.replayed:  # a redelivery: what is outstanding may have been launched by another result (no hop)
            await self._publish_outstanding(after)
        elif after is not before:
            await self._publish_launches(after, change.launches, hop_started)

    async def cancel(
        self,
        run_id: str,
        outcome: str = "cancelled",
        message: str | None = None,
        viewer: str | None = tenancy.ALL_TENANTS,
    ) -> RunDoc:
        """End ``viewer``'s run as ``cancelled`` (or ``expired``); its outstanding jobs are cancelled in the
        store."""
        doc = await self._find(run_id, viewer)  # not ``get``: it expires late runs through this method
        if doc is None:
            raise UnknownRun(run_id)
        return await self._cancel(doc, outcome, message or f"cancelled by a client (POST /v1/runs/{run_id}/cancel)")

    async def _cancel(self, doc: RunDoc, outcome: str, text: str) -> RunDoc:
        dag = await self.compiled_of(doc)

        def change(doc: RunDoc) -> RunDoc | None:
            old = _state(doc)
            return _updated(doc, old, evaluate.cancel(old, outcome, text), dag)

        _, after = await self.dags.update_run(store_id(doc), change)
        await self._cancel_outstanding(dag, after)
        return after

    async def get(self, run_id: str, viewer: str | None = tenancy.ALL_TENANTS) -> RunDoc:
        """``viewer``'s run ``run_id`` (``ALL_TENANTS``: the run the store names ``run_id``, see ``store_id``);
        ``UnknownRun`` when there is none (another tenant's run is none)."""
        doc = await self._find(run_id, viewer)
        if doc is None:
            raise UnknownRun(run_id)
        if _overdue(doc):
            return await self._cancel(doc, "expired", "the run's timeout passed before it finished")
        return doc

    async def view(self, run_id: str, viewer: str | None = tenancy.ALL_TENANTS) -> dict[str, Any]:
        doc = await self.get(run_id, viewer)
        return view_of(await self.compiled_of(doc), doc)

    async def wait(self, run_id: str, timeout_s: float, viewer: str | None = tenancy.ALL_TENANTS) -> RunDoc:
        """The run's document once it is over, or as it is after ``timeout_s`` (``UnknownRun`` at once for
        another tenant's run)."""
        deadline = time.monotonic() + timeout_s
        doc = await self.get(run_id, viewer)
        sid = store_id(doc)
        while doc.get("finished_at") is None and (remaining := deadline - time.monotonic()) > 0:
            changed = await self.dags.wait_change(sid, doc, min(remaining, 1.0))
            if changed is None:
                raise UnknownRun(run_id)  # expired while it was waited for
            doc = changed if changed.get("finished_at") or not _overdue(changed) else await self.get(sid)
        return doc

    # -- publishing -------------------------------------------------------------------------------------------
    async def _publish_outstanding(self, doc: RunDoc, hop_started: float | None = None) -> None:
        """Publish the jobs of ``doc`` that have no result yet (``hop_started``: see ``_publish_launches``)."""
        dag = await self.compiled_of(doc)
        await self._publish_launches(doc, await asyncio.to_thread(_outstanding, dag, _state(doc)), hop_started)

    async def _publish_launches(
        self, doc: RunDoc, launches: list[evaluate.StepLaunch], hop_started: float | None = None
    ) -> None:
        """Publish the jobs of ``launches``, recorded in ``doc``. ``hop_started``: when the record that launched
        them was stored (their ``DagContext.hop_started``); None for a run's first steps."""
        jobs = [(launch, job) for launch in launches for job in launch.jobs]
        # Concurrently, a window at a time: a fan-out's jobs cost about one broker round trip, not one each.
        for start in range(0, len(jobs), PUBLISH_WINDOW):
            window = (self._publish(doc, step, job, hop_started) for step, job in jobs[start : start + PUBLISH_WINDOW])
            outcomes = await asyncio.gather(*window, return_exceptions=True)
            failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if failed is not None:
                raise failed

    async def _publish(
        self, doc: RunDoc, launch: evaluate.StepLaunch, job: evaluate.JobLaunch, hop_started: float | None = None
    ) -> None:
        started = (doc["times"].get(launch.step_id) or {}).get("started_at") or time.time()
        deadlines = [d for d in (doc.get("deadline"), launch.timeout_s and started + launch.timeout_s) if d]
        message = RequestMessage(
            job_id=job.job_id,
            model=launch.model,
            input=job.input,
            submitted_at=started,
            deadline=min(deadlines) if deadlines else None,
            dag=DagContext(
                run=doc["run"]["run_id"],
                dag=doc["run"]["dag"],
                version=doc["version"],
                step=launch.step_id,
                index=job.index,
                runs=None if launch.retries is None else launch.retries + 1,
                hop_started=hop_started,
            ),
            tenant=doc.get("tenant"),
        )
        subject = c.request_subject(launch.model)
        traced = tracing.active()
        if traced is None:
            await self.broker.publish(subject, message.model_dump_json().encode(), msg_id=job.job_id)
            return
        headers: dict[str, str] = {}
        # a PRODUCER span under the hop, else under the run's root span (its start, a republish)
        with traced.resumed(None if traced.current_traceparent() else doc.get("traceparent")):
            with traced.publish(self.broker.scheme, subject, job.job_id, launch.model, headers, tenant=message.tenant):
                data = message.model_dump_json().encode()
                await self.broker.publish(subject, data, msg_id=job.job_id, headers=headers)

    async def _cancel_outstanding(self, dag: CompiledDag, doc: RunDoc) -> None:
        """Cancel the jobs of a run that is over which have no result yet, so that no worker computes them."""
        state = _state(doc)
        error = JobError(type="cancelled", message=f"its DAG run {state.run_id} ended {_status(dag, doc)}")
        tenant = doc.get("tenant")  # the store leaves a record of another tenant (or model) under a step's id alone
        items = [
            Finish(
                job_id(state.run_id, sid, i, state.key),
                JobState.cancelled,
                dag.steps[sid].spec.model,
                error=error,
                tenant=tenant,
            )
            for sid, run in state.steps.items()
            for i, item in enumerate(run.items)
            if item == "pending"
        ]
        if items:
            await self.store.finish_many(items)


class _Change:
    """What a settled batch changes in a run's document. ``update_run`` may apply it more than once (to a newer
    document after a conflict); it remembers of the last application whether a result was there already
    (``replayed``) and the jobs it launched, rendered once (``launches``)."""

    def __init__(self, dag: CompiledDag, results: list[tuple[DagContext, JobRecord]]) -> None:
        self.dag = dag
        self.results = results
        self.replayed = False  # a result the run had already: its first settle may have died before publishing
        self.launches: list[evaluate.StepLaunch] = []
        self._prepared: tuple[RunDoc, RunDoc | None, bool, list[evaluate.StepLaunch]] | None = None

    def prepare(self, doc: RunDoc) -> None:
        """Apply to ``doc`` now (in a thread); a later call with an equal document reuses the result."""
        new = self(doc)
        self._prepared = (doc, new, self.replayed, self.launches)

    def __call__(self, doc: RunDoc) -> RunDoc | None:
        if self._prepared is not None and self._prepared[0] == doc:
            _, new, self.replayed, self.launches = self._prepared
            return new
        with limits.value_budget():
            return self._apply(doc)

    def _apply(self, doc: RunDoc) -> RunDoc | None:
        dag = self.dag
        self.replayed = False
        old = _state(doc)
        new = _expire_if_late(doc, old)  # first: a job that expired with its run does not make it 'failed'
        for item, record in self.results:
            if record.job_id != job_id(old.run_id, item.step, item.index, old.key):
                log.warning(
                    "job %s is not step %s[%d] of DAG run %s: ignored", record.job_id, item.step, item.index, old.run_id
                )
                continue
            output, error = record.output, _error_dict(record.error)
            applied = evaluate.apply_result(dag, new, item.step, item.index, record.state.value, output, error)
            self.replayed = self.replayed or applied is new
            new = applied
        new, self.launches = evaluate.advance(dag, new)
        return _updated(doc, old, new, dag)


class _Lenient(Mapping[str, ModelSpec]):
    """The models a stored spec names: known ones as they are; one this process does not serve passes as a stand-in
    (the spec was checked against it when it was registered)."""

    def __init__(self, known: Mapping[str, ModelSpec], spec: Any) -> None:
        from fleet.schemas.models import BUILTIN_SPECS

        self._known = {**BUILTIN_SPECS, **known}
        self._names = {step.model for step in spec.steps}

    def __getitem__(self, name: str) -> ModelSpec:
        if name in self._known:
            return self._known[name]
        if name in self._names:
            from fleet.schemas.models import BUILTIN_SPECS

            return _any_input(BUILTIN_SPECS["echo"], name)
        raise KeyError(name)

    def __iter__(self) -> Any:
        return iter({*self._known, *self._names})

    def __len__(self) -> int:
        return len({*self._known, *self._names})


def _any_input(spec: ModelSpec, name: str) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, name=name)


def _load_and_validate(source: Any, models: Mapping[str, ModelSpec]) -> tuple[Any, CompiledDag]:
    spec = load_spec(source)
    return spec, validate(spec, models)


def _load_stored(raw: Any, models: Mapping[str, ModelSpec]) -> CompiledDag:
    spec = load_spec(raw)
    return validate(spec, _Lenient(models, spec))


def _first_state(dag: CompiledDag, run_id: str, run_input: Any, key: str) -> tuple[RunState, bool]:
    """A new run with ``key`` and its first steps launched, and whether it is over at its start (in a thread: the
    evaluation is bounded, but not free)."""
    with limits.value_budget():
        try:
            state = replace(evaluate.new_run(dag, run_id, run_input), key=key)
        except RecursionError:  # an input_schema such as {"$ref": "#"}: jsonschema recurses without end
            raise InvalidInput("the run input cannot be checked: the DAG's input_schema refers to itself") from None
        state = evaluate.advance(dag, state)[0]
        return state, evaluate.run_state(dag, state).state != "running"


def _outstanding(dag: CompiledDag, state: RunState) -> list[evaluate.StepLaunch]:
    with limits.value_budget():
        return evaluate.outstanding(dag, state)


def _error_dict(error: JobError | None) -> dict[str, Any] | None:
    return None if error is None else {"type": error.type, "message": error.message}


def _expire_if_late(doc: RunDoc, state: RunState) -> RunState:
    deadline = doc.get("deadline")
    if deadline and time.time() > deadline:
        return evaluate.cancel(state, "expired", "the run's timeout passed before it finished")
    return state


def _updated(doc: RunDoc, old: RunState, new: RunState, dag: CompiledDag) -> RunDoc | None:
    if new == old:
        return None
    doc = dict(doc)
    doc["run"] = new.to_dict()
    doc["times"] = dict(doc["times"])
    now = time.time()
    _stamp(doc, old, new, now)
    if doc.get("finished_at") is None and evaluate.run_state(dag, new).state != "running":
        doc["finished_at"] = now
    return doc


def _stamp(doc: RunDoc, old: RunState | None, new: RunState, now: float) -> None:
    for sid, run in new.steps.items():
        before = old.steps[sid].state if old is not None else "pending"
        times = dict(doc["times"].get(sid) or {"started_at": None, "finished_at": None})
        if before == "pending" and run.state != "pending" and run.state not in ("skipped", "cancelled"):
            times["started_at"] = now
        if before not in SETTLED and run.state in SETTLED:
            times["finished_at"] = now
        if times["started_at"] is not None or times["finished_at"] is not None:
            doc["times"][sid] = times


def _status(dag: CompiledDag, doc: RunDoc) -> str:
    return evaluate.run_state(dag, _state(doc)).state


def _state(doc: RunDoc) -> RunState:
    return RunState.from_dict(doc["run"], doc.get("key"))


def store_id(doc: RunDoc) -> str:
    """The id under which the DAG store keeps a run: ``<tenant>:<run>`` (the bare run id for the default tenant,
    and for a run from before keys). The operator reads a run by this id."""
    run_id: str = doc["run"]["run_id"]
    return scoped(run_id, doc.get("tenant")) if doc.get("key") else run_id


def spec_ref(doc: RunDoc) -> str:
    """The name under which the DAG store keeps the spec a run runs (as ``store_id``)."""
    name: str = doc["run"]["dag"]
    return scoped(name, doc.get("tenant")) if doc.get("key") else name


def view_of(dag: CompiledDag, doc: RunDoc) -> dict[str, Any]:
    """``GET /v1/runs/{id}``: ``{run_id, dag, version, state, steps: {<id>: {state, job_ids, started_at,
    finished_at, error}}, output, error, created_at, finished_at}``."""
    state = _state(doc)
    view = evaluate.run_view(dag, state)
    for sid, step in view["steps"].items():
        times = doc["times"].get(sid) or {}
        step["started_at"] = times.get("started_at")
        step["finished_at"] = times.get("finished_at")
    view["version"] = doc["version"]
    view["created_at"] = doc["created_at"]
    view["finished_at"] = doc.get("finished_at")
    return view


def _overdue(doc: RunDoc) -> bool:
    """A run still going past its deadline (reading it ends it ``expired``)."""
    return bool(doc.get("deadline")) and doc.get("finished_at") is None and time.time() > doc["deadline"]


def _hop_started(results: list[tuple[DagContext, JobRecord]]) -> float:
    """When the records that settled together were stored: the latest of them (the one that completed what the
    next steps wait for), else now (a record without timings, e.g. a cancelled step's)."""
    stored = [r.timings.stored for _, r in results if r.timings is not None and r.timings.stored is not None]
    return max(stored) if stored else time.time()
