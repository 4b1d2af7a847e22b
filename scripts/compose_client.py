"""The outside checks of scripts/compose-check.sh: what a user of a compose fleet sees.

    python scripts/compose_client.py calls | status STATUS_JSON | flower
    python scripts/compose_client.py primary STATUS_JSON HOST:PORT[,HOST:PORT...]

`calls` sends every model of the check's catalog twice through a plain Celery client (no
gpufleet import: `send_task` by name, JSON only) and checks each answer; `status` reads
`gpufleet status --json` and checks both simulated GPUs are live; `primary` checks
Redis's primary is one of those named; `flower` checks Flower refuses a request without
credentials. The client's
settings come from GPUFLEET_CHECK_CONF (`gpufleet url --json`, a fleet behind Sentinels)
or else GPUFLEET_CHECK_URL; Flower's address from GPUFLEET_CHECK_FLOWER.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from celery import Celery

MODELS = ("a", "b", "c")  # 5 GiB each on 2 x 8 GiB: never all resident


def calls() -> None:
    app = Celery()
    if os.environ.get("GPUFLEET_CHECK_CONF"):
        app.conf.update(**json.loads(os.environ["GPUFLEET_CHECK_CONF"])["celery"])
    else:
        url = os.environ["GPUFLEET_CHECK_URL"]
        app.conf.update(broker_url=url, result_backend=url, task_serializer="json")
        app.conf.update(accept_content=["json"], result_serializer="json")
    served: Counter[str] = Counter()
    for model in MODELS * 2:
        start = time.monotonic()
        answer = app.send_task("gpufleet.infer", args=(model, "hello from the host")).get(
            timeout=180
        )
        assert answer["model"] == model, answer
        assert answer["outputs"]["shape"], answer
        served[answer["cache"]] += 1
        print(f"{model}: {answer['cache']} on {answer['worker']}, {time.monotonic() - start:.2f} s")
    assert served["hot"] < len(MODELS) * 2, f"no call evicted or loaded: {served}"
    print(f"{sum(served.values())} calls answered: {dict(served)}")


def status(path: str) -> None:
    report = json.loads(Path(path).read_text())
    live = [g["id"] for g in report["gpus"] if g["alive"]]
    assert len(live) == 2, report["gpus"]
    print(f"status: {len(live)} live GPUs {live}, {len(report['deployments'])} deployments")
    print(f"status: Redis {report['redis']}")


def primary(path: str, expected: str) -> None:
    redis = json.loads(Path(path).read_text())["redis"]
    assert redis["primary"] in expected.split(","), (expected, redis)
    print(f"status: Redis {redis}")


def flower() -> None:
    try:
        urllib.request.urlopen(os.environ["GPUFLEET_CHECK_FLOWER"], timeout=10)
    except urllib.error.HTTPError as exc:
        assert exc.code == 401, exc.code
        print("flower: 401 without credentials")
        return
    raise SystemExit("flower answered without credentials")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"calls": calls, "status": status, "primary": primary, "flower": flower}[command](*args)
