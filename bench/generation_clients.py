"""The callers of `bench.generation`, each kind in client processes of its own, as
separate users are (32 threads of one process would wait for one another's interpreter
lock, which the fleet's figures should not count).

- `plain_clients`: plain Celery clients, configured only by what `gpufleet url --json`
  prints (`tasks.config.caller_conf`), each sending its share of the calls by name at once
  and then reading their answers, as a user's batch job would: the router's hop included,
  as a caller's URL has it. Each call's time to send, and its answer.
- `streamed_once`: every call streamed through the project's client, a thread each: each
  call's time to its first streamed text, and whether the pieces join into its answer.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.workloads import MODEL

CALL_TIMEOUT_S = 600.0


def in_processes(
    target: Callable[..., None], arguments: tuple[Any, ...], count: int, processes: int
) -> tuple[list[Any], float]:
    """`target(*arguments, indices, ready, out)` in `processes` spawned processes (fresh
    clients, not forks of this one), the calls' indices dealt out among them; each waits
    at `ready` until all are, then puts one row per call on `out`. The `count` rows, and
    when the processes were released (`time.monotonic()`)."""
    spawn = multiprocessing.get_context("spawn")
    ready, out = spawn.Barrier(processes + 1), spawn.Queue()
    workers = [
        spawn.Process(
            target=target, args=(*arguments, list(range(p, count, processes)), ready, out)
        )
        for p in range(processes)
    ]
    try:
        for worker in workers:
            worker.start()
        ready.wait(timeout=CALL_TIMEOUT_S)
        start = time.monotonic()
        rows = [out.get(timeout=CALL_TIMEOUT_S) for _ in range(count)]
    finally:
        for worker in workers:
            worker.join(timeout=CALL_TIMEOUT_S)
            if worker.is_alive():
                worker.terminate()
    return rows, start


def _plain_process(
    conf: dict[str, Any], calls: list[tuple[str, int]], indices: list[int], ready: Any, out: Any
) -> None:
    """One plain client: a warm-up call opens its connections; then, once every process
    is `ready`, its calls sent one after another, then read: puts (index, send ms,
    answer or error text, when it was read: time.monotonic()) on `out`."""
    from celery import Celery

    app = Celery("plain-client")
    app.conf.update(**conf)
    warm = app.send_task("gpufleet.infer", args=(MODEL, "warm", {"max_new_tokens": 1}))
    warm.get(timeout=CALL_TIMEOUT_S)
    ready.wait(timeout=CALL_TIMEOUT_S)
    sent = []
    for index in indices:
        prompt, new = calls[index]
        start = time.perf_counter()
        result = app.send_task("gpufleet.infer", args=(MODEL, prompt, {"max_new_tokens": new}))
        sent.append((index, (time.perf_counter() - start) * 1000, result))
    for index, send_ms, result in sent:
        try:
            answer: Any = result.get(timeout=CALL_TIMEOUT_S)
        except Exception as exc:
            answer = f"{type(exc).__name__}: {exc}"[:200]
        out.put((index, send_ms, answer, time.monotonic()))


def plain_clients(
    calls: list[tuple[str, int]], processes: int, conf: dict[str, Any]
) -> dict[str, Any]:
    """Every call at once from `processes` plain Celery clients (see the module): seconds
    from their release to the last answer, and each call's (send ms, answer) in order."""
    rows, start = in_processes(_plain_process, (conf, calls), len(calls), processes)
    rows.sort(key=lambda row: row[0])
    errors = [row[2] for row in rows if isinstance(row[2], str)]
    return {
        "seconds": max(row[3] for row in rows) - start,
        "send_ms": [row[1] for row in rows],
        "answers": [row[2] for row in rows],
        "errors": errors,
    }


def _stream_one(prompt: str, new: int, go: threading.Barrier) -> tuple[float, bool, str]:
    """One streamed call, sent once `go` opens: its TTFT (ms, from its own send), whether
    its pieces joined equal its answer, and its error ("" when none)."""
    from tasks.api import infer  # imported by `_call_threads` before any thread starts
    from tasks.app import app
    from tasks.serving import streams

    go.wait(timeout=CALL_TIMEOUT_S)
    start = time.perf_counter()
    ttft = 0.0
    try:
        call = infer.apply_async((MODEL, prompt, {"max_new_tokens": new, "stream": True}))
        pieces = []
        for _, piece in streams.read(app.backend.client, call.id, call.ready, CALL_TIMEOUT_S):
            if not ttft:
                ttft = (time.perf_counter() - start) * 1000
            pieces.append(piece)
        answer = call.get(timeout=CALL_TIMEOUT_S)
        return ttft, "".join(pieces) == answer["outputs"]["texts"][0], ""
    except Exception as exc:
        return ttft, False, f"{type(exc).__name__}: {exc}"[:200]


def _call_threads(
    calls: list[tuple[str, int]], indices: list[int], before: Callable[[], object]
) -> tuple[list[tuple[int, float, bool, str]], float]:
    """A thread per call of `indices`, all sent at once after `before()` returns: each
    one's (index, TTFT, joined right, error), and when they were let go."""
    import tasks.api  # noqa: F401 - before the threads: none may still be importing at `go`

    go = threading.Barrier(len(indices) + 1)
    done: list[tuple[int, float, bool, str]] = []

    def caller(index: int) -> None:
        done.append((index, *_stream_one(*calls[index], go)))

    threads = [threading.Thread(target=caller, args=(i,)) for i in indices]
    for thread in threads:
        thread.start()
    before()
    go.wait(timeout=CALL_TIMEOUT_S)
    start = time.monotonic()
    for thread in threads:
        thread.join()
    return done, start


def _callers(calls: list[tuple[str, int]], indices: list[int], ready: Any, out: Any) -> None:
    """A caller process (`streamed_once`): its calls sent once every process is `ready`;
    puts each one's (index, TTFT, joined right, error) on `out`. One short call first
    opens its connections (broker, results, registry), as the parent's are open already."""
    from tasks.api import infer

    infer.delay(MODEL, "warm", {"max_new_tokens": 1}).get(timeout=CALL_TIMEOUT_S)
    done, _ = _call_threads(calls, indices, lambda: ready.wait(timeout=CALL_TIMEOUT_S))
    for row in done:
        out.put(row)


def streamed_once(calls: list[tuple[str, int]], processes: int) -> dict[str, Any]:
    """Every call at once, streamed (through the project's client and Redis), timed: each
    call's time to its first text, and whether its pieces join into its own answer. The
    callers are threads of `processes` client processes (started first, then released
    together), as separate clients are: 32 threads of one process wait for one another's
    interpreter lock, which a fleet's TTFT should not count. With 1, threads of this one."""
    ttft = [0.0] * len(calls)
    joined_right = [False] * len(calls)
    errors: list[str] = []
    if processes <= 1:
        results, start = _call_threads(calls, list(range(len(calls))), lambda: None)
    else:  # fresh clients, not forks of this one
        results, start = in_processes(_callers, (calls,), len(calls), processes)
    seconds = time.monotonic() - start
    for index, first, joined, error in results:
        ttft[index], joined_right[index] = first, joined
        if error:
            errors.append(error)
    return {"seconds": seconds, "ttft_ms": ttft, "joined_right": joined_right, "errors": errors}
