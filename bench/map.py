"""How fast the live placement map draws a large fleet in a real browser, against the same
page with a small one.

    python -m bench.map [--gpus 1000] [--small 10] [--rounds 5] > bench/out/map.json

Prints one JSON object. It starts a private Redis (with a password: the map opens with
it) and writes two fleets' ledgers into it as `bench.placement` does (no workers: GPUs
registered with day-long leases, two HOT replicas a GPU, one and eight GPUs a host):
`--gpus` GPUs and `--small` GPUs, the baseline measured in the same run. For each, a
`gpufleet api` serves the map, and Debian's headless Chromium (tests/browser.py, the one
tests/test_map.py drives) loads it `--rounds` times, the two sizes taking turns. Reported
per size, medians over the rounds:

- `first_picture_ms`: from the navigation's start to the page's first drawing of the
  map (its `map-rendered` mark: the page, its event stream's first state, and the hosts
  drawn; with more than 16 hosts they are drawn folded, a bar each);
- `all_open_ms`: one drawing with every host open (a search that matches every GPU),
  as a person searching the fleet sees it;
- `build_ms`: the front's feed reading the ledger into the map once (in this process);
- `state_ms`, `state_bytes`: one `GET /map/state` (the feed's latest map), and its size.

Target (issue 78): `first_picture_ms` <= 1,000 at 1,000 GPUs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from base64 import b64encode
from pathlib import Path
from typing import Any

from bench.fleet import fleet_machine
from bench.placement import Config, build_fleet
from placement.ledger.registry import Registry
from placement.server.redis_server import RedisServer
from tasks.front.fleet_map import MapFeed
from tests.browser import CHROMIUM, chromium, sign_in

log = logging.getLogger("bench.map")

PASSWORD = "bench-map"
USER = "operator"  # a URL without a user name opens the map as the operator (fleet_map)
TARGET_MS = 1000.0
REPO = Path(__file__).resolve().parents[1]


def serve_map(url: str, fleet: str, home: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A `gpufleet api` of `fleet` reading with `url`; its map's URL."""
    with socket.socket() as sock:  # a port nothing listens on now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    keys = home / f"{fleet}-keys"
    env = {**os.environ, "GPUFLEET_HOME": str(home), "GPUFLEET_FLEET": fleet}
    env.update(GPUFLEET_REDIS_URL=url, GPUFLEET_OPERATOR_URL=url, HF_HUB_OFFLINE="1")
    env["GPUFLEET_MODELS"] = str(REPO / "models.yaml")
    cli = [sys.executable, "-m", "tasks.operator.cli"]
    subprocess.run([*cli, "api-key", "--keys", str(keys)], env=env, check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    proc = subprocess.Popen(
        [*cli, "api", "--port", str(port), "--keys", str(keys)], env=env, cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=sys.stderr.fileno(),
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}/map"


def get_state(url: str) -> tuple[float, int]:
    """One `GET /map/state`: milliseconds and bytes."""
    token = b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(url + "/state", headers={"Authorization": f"Basic {token}"})
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as answer:
        body = answer.read()
    return (time.perf_counter() - began) * 1000, len(body)


def wait_serving(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            get_state(url)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def one_load(driver: Any, url: str) -> dict[str, float]:
    """Load the map once; the time to its first picture, then one drawing all open."""
    driver.get("about:blank")
    driver.get(url)
    deadline = time.monotonic() + 60
    while not driver.execute_script("return document.body.dataset.rendered === '1'"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} drew nothing within 60 s")
        time.sleep(0.01)
    first = driver.execute_script(
        "return performance.getEntriesByName('map-rendered')[0].startTime"
    )
    opened, shown = driver.execute_script(
        "const box = document.getElementById('search');"
        "const began = performance.now();"
        "box.value = 'gpu-'; box.dispatchEvent(new Event('input'));"
        "const took = performance.now() - began;"
        "const shown = document.querySelectorAll('[data-gpu]').length;"
        "box.value = ''; box.dispatchEvent(new Event('input'));"
        "return [took, shown];"
    )
    return {"first_picture_ms": float(first), "all_open_ms": float(opened), "gpus_drawn": shown}


def build_ms(url: str, fleet: str) -> float:
    """How long the feed takes to read the map once (median of 5), in this process."""
    feed = MapFeed(url, fleet)
    took = []
    for _ in range(5):
        began = time.perf_counter()
        feed.read()
        took.append((time.perf_counter() - began) * 1000)
    return statistics.median(took)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--small", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    sizes = {"large": args.gpus, "small": args.small}
    procs: list[subprocess.Popen[bytes]] = []
    with RedisServer(password=PASSWORD) as server, tempfile.TemporaryDirectory() as tmp:
        urls: dict[str, str] = {}
        built: dict[str, Any] = {}
        for name, gpus in sizes.items():
            fleet = f"map{gpus}"
            cfg = Config(
                server.url, fleet, clients=1, gpus=gpus, deployments=2 * gpus, seconds=0,
                warmup=0, gpus_per_worker=8, replicas_per_model=2, seed=1,
            )  # fmt: skip
            log.info("writing a ledger of %d GPUs", gpus)
            built[name] = build_fleet(Registry.from_url(server.url, fleet), cfg)
            built[name]["build_ms"] = build_ms(server.url, fleet)
            proc, urls[name] = serve_map(server.url, fleet, Path(tmp))
            procs.append(proc)
        driver = None
        try:
            for url in urls.values():
                wait_serving(url)
            driver = chromium()
            sign_in(driver, USER, PASSWORD)
            loads: dict[str, list[dict[str, float]]] = {name: [] for name in sizes}
            states: dict[str, list[tuple[float, int]]] = {name: [] for name in sizes}
            for url in urls.values():  # one unmeasured load each: caches, the feed
                one_load(driver, url)
            for _ in range(args.rounds):
                for name, url in urls.items():
                    loads[name].append(one_load(driver, url))
                    states[name].append(get_state(url))
        finally:
            if driver is not None:
                driver.quit()
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
    result: dict[str, Any] = {"rounds": args.rounds}
    for name, gpus in sizes.items():
        rows = loads[name]
        result[name] = {
            "gpus": gpus,
            "hosts": built[name]["workers"],
            "gpus_drawn_all_open": rows[-1]["gpus_drawn"],
            "first_picture_ms": round(statistics.median(r["first_picture_ms"] for r in rows), 1),
            "first_picture_ms_rounds": [round(r["first_picture_ms"], 1) for r in rows],
            "all_open_ms": round(statistics.median(r["all_open_ms"] for r in rows), 1),
            "build_ms": round(built[name]["build_ms"], 1),
            "state_ms": round(statistics.median(s[0] for s in states[name]), 1),
            "state_bytes": states[name][-1][1],
        }
    large, small = result["large"], result["small"]
    result["first_picture_ratio"] = round(large["first_picture_ms"] / small["first_picture_ms"], 2)
    result["target_ms"] = TARGET_MS
    result["meets_target"] = large["first_picture_ms"] <= TARGET_MS
    machine = {k: v for k, v in fleet_machine("").items() if k != "gpus"}  # no worker runs
    result["machine"] = {**machine, "browser": browser_version()}
    json.dump(result, sys.stdout, indent=2)
    print()


def browser_version() -> str:
    done = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True,
                          check=False, timeout=30)  # fmt: skip
    return done.stdout.strip()


if __name__ == "__main__":
    main()
