"""A batch's results are read together and stored as Celery's Redis backend stores each one."""

from __future__ import annotations

import json

import redis
from celery import Celery, states
from celery.exceptions import Ignore

from placement.server.redis_server import RedisServer
from tasks.broker.results import read_together
from tasks.serving import batch_jobs


def test_a_batchs_results_take_one_read_and_are_what_celery_writes() -> None:
    with RedisServer() as server:
        app = Celery("results-test", broker=server.url, backend=server.url)
        app.conf.update(result_serializer="json", result_extended=True, result_expires=3600)
        backend = app.backend
        client = redis.Redis.from_url(server.url)
        key = backend.get_key_for_task
        backend.store_result("alone", {"x": 0}, states.SUCCESS)  # Celery's own write
        backend.store_result("b", {"old": True}, states.SUCCESS)  # answered already
        ids = ["a", "b", "c"]
        client.config_resetstat()
        with read_together(backend, ids):
            for i, task_id in enumerate(ids):
                backend.store_result(task_id, {"x": i}, states.SUCCESS)
                assert client.exists(key(task_id))  # written at once, as Celery writes it
        stats = client.info("commandstats")
        assert stats["cmdstat_mget"]["calls"] == 1 and "cmdstat_get" not in stats
        assert stats["cmdstat_setex"]["calls"] == stats["cmdstat_publish"]["calls"] == 2
        assert app.AsyncResult("a").get(timeout=5) == {"x": 0}
        assert app.AsyncResult("c").get(timeout=5) == {"x": 2}
        assert app.AsyncResult("b").get(timeout=5) == {
            "old": True
        }  # a success is never overwritten
        alone, together = (json.loads(client.get(key(t))) for t in ("alone", "a"))
        assert set(together) == set(alone) and together["status"] == "SUCCESS"
        assert 0 < client.ttl(key("a")) <= 3600
        client.config_resetstat()
        backend.store_result("d", {"x": 3}, states.SUCCESS)  # outside: Celery's path again
        stats = client.info("commandstats")
        assert stats["cmdstat_get"]["calls"] == 1 and "cmdstat_mget" not in stats


def test_a_batch_does_not_run_again_a_call_its_let_go_job_ran_and_runs_the_rest() -> None:
    """A job the pool let go with a lost connection may have run in the child before the
    next one; the next job runs again only the calls put back whose answers are not
    stored (`ChildCall.again`), and acknowledges the others unrun (Celery's `Ignore`)."""
    with RedisServer() as server:
        app = Celery("results-test", broker=server.url, backend=server.url)
        app.conf.update(result_serializer="json")
        app.backend.store_result("ran", {"x": 0}, states.SUCCESS)  # by the let-go job
        outcomes: dict[str, object] = {}

        def trace(name: str, task_id: str, *_: object) -> str:
            prepared = batch_jobs.take_prepared(task_id)
            assert prepared is not None
            try:
                outcomes[task_id] = prepared.served()
            except Ignore as exc:
                outcomes[task_id] = exc
            return task_id

        def job(task_id: str, again: bool) -> batch_jobs.ChildCall:
            return batch_jobs.ChildCall(
                trace, ("gpufleet.infer", task_id), {}, 0.0, f"{task_id}/1", again=again
            )

        served: list[str] = []

        def serve(fresh: list[batch_jobs.ChildCall]) -> list[object]:
            served.extend(j.task_id for j in fresh)
            return [f"answer of {j.task_id}" for j in fresh]

        jobs = [job("ran", True), job("not yet", True), job("new", False)]
        assert batch_jobs.run_batch(jobs, serve, app.backend) == ["ran", "not yet", "new"]
        assert served == ["not yet", "new"]
        assert isinstance(outcomes["ran"], Ignore)
        assert outcomes["not yet"] == "answer of not yet" and outcomes["new"] == "answer of new"
