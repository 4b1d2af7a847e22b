"""A batch's results are read together and stored as Celery's Redis backend stores each one,
without waiting for each reply."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import redis
from celery import Celery, states

from placement.redis_server import RedisServer
from tasks.results import together


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
        with together(backend, ids):
            for i, task_id in enumerate(ids):
                backend.store_result(task_id, {"x": i}, states.SUCCESS)
                assert _soon(lambda t=task_id: client.exists(key(t)))  # sent at once
        stats = client.info("commandstats")
        assert stats["cmdstat_mget"]["calls"] == 1 and "cmdstat_get" not in stats
        assert stats["cmdstat_setex"]["calls"] == stats["cmdstat_publish"]["calls"] == 2
        assert app.AsyncResult("a").get(timeout=5) == {"x": 0}
        assert app.AsyncResult("c").get(timeout=5) == {"x": 2}
        assert app.AsyncResult("b").get(timeout=5) == {
            "old": True
        }  # a success is never overwritten
        alone, shared = (json.loads(client.get(key(t))) for t in ("alone", "a"))
        assert set(shared) == set(alone) and shared["status"] == "SUCCESS"
        assert 0 < client.ttl(key("a")) <= 3600
        client.config_resetstat()
        backend.store_result("d", {"x": 3}, states.SUCCESS)  # outside: Celery's path again
        stats = client.info("commandstats")
        assert stats["cmdstat_get"]["calls"] == 1 and "cmdstat_mget" not in stats


def test_results_whose_replies_are_lost_are_stored_again_before_the_batch_ends() -> None:
    with RedisServer() as server:
        app = Celery("results-test", broker=server.url, backend=server.url)
        app.conf.update(result_serializer="json", result_extended=True)
        backend = app.backend
        client = redis.Redis.from_url(server.url)
        ids = ["a", "b", "c"]
        with together(backend, ids):
            client.client_pause(1500, all=False)  # writes wait; the batch's stay unread
            for i, task_id in enumerate(ids):
                backend.store_result(task_id, {"x": i}, states.SUCCESS)
            killed = client.client_kill_filter(_type="normal", skipme=True)
            assert killed >= 1  # the batch's connection, with its writes unrun
        assert all(client.exists(backend.get_key_for_task(t)) for t in ids)
        assert [app.AsyncResult(t).get(timeout=5) for t in ids] == [{"x": i} for i in range(3)]


def _soon(check: Callable[[], object], seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
