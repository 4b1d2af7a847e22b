"""A load of calls on a running fleet, from threads of one client, with when each was sent
and answered and by which host: what the failover tests measure their faults by."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from celery import Celery


class Load:
    """Threads that call the fleet one call after another through `client`, thread i
    calling model `models[i % len(models)]`."""

    def __init__(self, client: Celery, models: str = "ab") -> None:
        self.client = client
        self.models = models
        self.sent = 0
        self.calls: list[tuple[float, float, str]] = []  # (sent, answered, host), time.time()
        self.answered: list[str] = []  # the answered calls' task ids
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, threads: int) -> None:
        for i in range(threads):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _run(self, i: int) -> None:
        model = self.models[i % len(self.models)]
        while not self._stop.is_set():
            with self._lock:
                self.sent += 1
            sent = time.time()
            try:
                result = self.client.send_task("gpufleet.infer", args=[model, [f"call {i}"]])
                answer = result.get(timeout=60)
                assert answer["model"] == model, answer
                host = answer["worker"].split("@")[1].split("-")[0]
                with self._lock:
                    self.calls.append((sent, time.time(), host))
                    self.answered.append(result.id)
            except Exception as exc:
                with self._lock:
                    self.errors.append(repr(exc))

    def until(self, answered: int, after: float = 0.0, seconds: float = 60.0) -> None:
        """Wait until `answered` calls were answered after `after` (a time.time())."""
        deadline = time.monotonic() + seconds
        while len([done for _, done, _ in self.calls if done > after]) < answered:
            assert time.monotonic() < deadline, (len(self.calls), self.errors[:3])
            time.sleep(0.1)

    def both_hosts(self, after: float) -> Callable[[], bool]:
        """Whether h1 and h2 each answered a call sent after `after` (a time.time())."""
        return lambda: {host for sent, _, host in list(self.calls) if sent > after} == {"h1", "h2"}

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)
        assert not any(t.is_alive() for t in self._threads)
