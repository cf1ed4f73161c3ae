"""Celery's chord failures, as regression tests of Fleet's DAG runs (memory, NATS + Redis, Kafka + Redis).

Celery's chord (a group whose results feed a callback) is the cautionary anchor of issue 10: joins that never fire
after a retried member, error callbacks called twice or never, chains inside chords that lose their results. Each
test names the celery issue whose class of failure it pins down, runs the shape through real workers, and also
replays a settle (what a redelivery does) to show that a duplicate changes nothing.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

from fleet.schemas.jobs import JobState
from fleet.schemas.wire import DagContext, RequestMessage
from tests.dag_fixtures import fleet_fixture, infra_fixture, settings_fixture  # noqa: F401  (fixtures)
from tests.dagkit import DagFleet, all_job_ids, terminal_once


def chord_spec(name: str, model: str, **each: Any) -> dict[str, Any]:
    """pre -> each (a fan-out over ``input.texts``; members listed in ``input.bad`` fail for good, those in
    ``input.flaky`` fail retriably once) -> join -> post (reads the join's output)."""
    return {
        "name": name,
        "steps": [
            {"id": "pre", "model": model, "input": {"texts": "${input.texts}", "tag": "${input.tag}"}},
            {
                "id": "each",
                "model": model,
                "for_each": "${steps.pre.output.texts}",
                "input": {
                    "text": "${item}",
                    "key": "${join('-', [input.key, to_string(index)])}",
                    "fail": "${contains(input.bad, index)}",
                    "fail_first": "${contains(input.flaky, index) && `1` || `0`}",
                },
                **each,
            },
            {
                "id": "join",
                "model": model,
                "input": {
                    "key": "${join('-', [input.key, 'join'])}",
                    "texts": "${steps.each.outputs[*].text}",
                    "tag": "${steps.pre.output.tag}",
                },
            },
            {
                "id": "post",
                "model": model,
                "input": {"joined": "${join('+', steps.join.output.texts)}", "tag": "${steps.join.output.tag}"},
            },
        ],
        "output": "${steps.post.output}",
    }


def chord_input(texts: list[str], bad: tuple[int, ...] = (), flaky: tuple[int, ...] = ()) -> dict[str, Any]:
    return {"texts": texts, "key": uuid.uuid4().hex[:12], "bad": list(bad), "flaky": list(flaky), "tag": "t"}


async def replay(fleet: DagFleet, run_id: str, step: str, index: int) -> None:
    """Call the settle hook again for a job whose record is terminal, as a redelivery of its message does."""
    doc = await fleet.runner.get(run_id)
    job_id = (await fleet.ids(run_id))(step, index)
    record = await fleet.store.get(job_id)
    assert record is not None and record.terminal
    ctx = DagContext(run=run_id, dag=doc["run"]["dag"], version=doc["version"], step=step, index=index)
    request = RequestMessage(job_id=job_id, model=fleet.model, input={}, dag=ctx)
    await fleet.runner.on_settled(SimpleNamespace(request=request), record, False)


async def test_a_failing_member_reports_its_error_once_and_the_join_never_runs(fleet: DagFleet, unique) -> None:
    """celery#3317 (a chord header task fails: the error callback is not run, or the body runs anyway) and
    celery#6792: a fan-out member that fails for good fails the run once, with that member's error; one dead letter
    per failed job; the join and what follows never run."""
    run_input = chord_input(list("abcdef"), bad=(3,))
    view = await fleet.run(chord_spec(f"c3317-{unique}", fleet.model), run_input)
    run, k = view["run_id"], run_input["key"]
    jid = await fleet.ids(run)
    assert view["state"] == "failed"
    assert view["error"]["step"] == "each" and f"step {k}-3 fails for good" in view["error"]["message"]
    assert view["steps"]["join"]["job_ids"] == [] and view["steps"]["post"]["job_ids"] == []
    assert fleet.runs_of(f"{k}-join") == 0
    assert await fleet.store.get_many([jid("join", 0), jid("post", 0)]) == [None, None]
    assert await fleet.dead_letters(unique) == [jid("each", 3)], "one dead letter, for the failed member only"
    ended = [a for b, a in fleet.dags.of(run) if b["run"]["outcome"] is None and a["run"]["outcome"] is not None]
    assert len(ended) == 1, "the run's failure is recorded once"
    await terminal_once(fleet, all_job_ids(view))
    changes = len(fleet.dags.changes)
    await replay(fleet, run, "each", 3)
    assert len(fleet.dags.changes) == changes, "a redelivered failure changes nothing"
    assert fleet.runs_of(f"{k}-join") == 0


async def test_a_member_retried_then_successful_still_lets_the_join_fire_once(fleet: DagFleet, unique) -> None:
    """celery#1401 (the chord body is never executed if a header task was retried) and celery#8211: members that
    fail retriably and then succeed count once each, and the join fires exactly once with every result."""
    run_input = chord_input([f"x{i}" for i in range(6)], flaky=(1, 4))
    view = await fleet.run(chord_spec(f"c1401-{unique}", fleet.model, retries=2), run_input)
    run, k = view["run_id"], run_input["key"]
    jid = await fleet.ids(run)
    assert view["state"] == "succeeded", view
    assert view["output"] == {"joined": "+".join(f"x{i}" for i in range(6)), "tag": "t"}
    records = await fleet.store.get_many([jid("each", i) for i in range(6)])
    assert [r.deliveries for r in records if r] == [1, 2, 1, 1, 2, 1]
    assert [fleet.runs_of(f"{k}-{i}") for i in range(6)] == [1, 2, 1, 1, 2, 1]
    assert view["steps"]["join"]["job_ids"] == [jid("join", 0)] and fleet.runs_of(f"{k}-join") == 1
    await terminal_once(fleet, all_job_ids(view))
    for index in (1, 4, 5):  # the retried members and the last one, redelivered after the join fired
        await replay(fleet, run, "each", index)
    assert fleet.runs_of(f"{k}-join") == 1, "a redelivered member never fires the join again"
    assert await fleet.dead_letters(unique) == []


async def test_a_fan_in_inside_a_chain_keeps_its_results(fleet: DagFleet, unique) -> None:
    """celery#4161 (a chain inside a chord's body discards the header's results) and celery#9107: in
    pre -> fan-out -> join -> post, the join gets every member's output in order and the step after the join reads
    the join's output, not the members'."""
    run_input = chord_input(["b", "a", "d", "c"])
    view = await fleet.run(chord_spec(f"c4161-{unique}", fleet.model), run_input)
    run = view["run_id"]
    jid = await fleet.ids(run)
    assert view["state"] == "succeeded", view
    join = await fleet.store.get(jid("join", 0))
    assert join is not None and join.output["texts"] == ["b", "a", "d", "c"] and join.output["tag"] == "t"
    assert view["output"] == {"joined": "b+a+d+c", "tag": "t"}
    starts = {sid: step["started_at"] for sid, step in view["steps"].items()}
    assert starts["pre"] <= starts["each"] <= starts["join"] <= starts["post"]
    await terminal_once(fleet, all_job_ids(view))


async def test_error_handling_is_not_called_twice(fleet: DagFleet, unique) -> None:
    """celery#6792 / celery#8211 (a chord's error callback called more than once when several members fail): with
    every member failing, in any order, the run fails once with the lowest index's error, each failed job is dead
    lettered once, and replaying every member's settle changes nothing."""
    run_input = chord_input(list("abcd"), bad=(0, 1, 2, 3))
    view = await fleet.run(chord_spec(f"c6792-{unique}", fleet.model), run_input)
    run, k = view["run_id"], run_input["key"]
    jid = await fleet.ids(run)
    assert view["state"] == "failed" and f"step {k}-0 fails for good" in view["error"]["message"]
    docs = [a for _, a in fleet.dags.of(run)]
    failures = [d for d in docs if d["run"]["outcome"] == "failed"]
    assert len({repr(d["run"]["error"]) for d in failures}) == 1, "the run's error never changes once set"
    ended = [a for b, a in fleet.dags.of(run) if b["run"]["outcome"] is None and a["run"]["outcome"] is not None]
    assert len(ended) == 1
    letters = await fleet.dead_letters(unique)
    assert sorted(letters) == [jid("each", i) for i in range(4)], "one dead letter per failed job"
    records = await fleet.store.get_many([jid("each", i) for i in range(4)])
    assert all(r is not None and r.state is JobState.failed and r.deliveries == 1 for r in records)
    await terminal_once(fleet, all_job_ids(view))
    changes = len(fleet.dags.changes)
    for index in range(4):
        await replay(fleet, run, "each", index)
    assert len(fleet.dags.changes) == changes and fleet.runs_of(f"{k}-join") == 0
