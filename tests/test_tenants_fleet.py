"""Tenants through a real fleet: plain Celery clients configured from `gpufleet url
--tenant NAME --json`, against one `gpufleet up` (a router, one simulated GPU).

- a tenant's burst delays another tenant's calls by about a batch, not by the burst;
- tenants that flood at once share the answers by their weights;
- a tenant removed while its calls wait: every one is answered, and its user is gone;
- `--max-running`: never more of a tenant's calls at once, none failing for it;
  `--max-queued`: the calls past it refused at once with `QuotaError`;
- a tenant's URL cannot read, hear, stream or cancel another tenant's call, even with its
  task id; a tenant's chain runs as its own calls, answered where its client reads.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from bench.fairness import weighted
from tests.ports import free_port
from tests.running import REPO, RunningFleet, fleet_env, fleet_up, until
from tests.test_dashboard import missing_from, served_names
from tests.test_tenants import heard

pytestmark = pytest.mark.slow

SLOW = "{model_type: gpt2, n_layer: 6, n_head: 6, n_embd: 384, vocab_size: 2048, n_positions: 1024}"
CATALOG = f"""models:
  m: {{source: synthetic, task: forward, memory: 256MiB}}
  slow: {{source: synthetic, task: text-generation, memory: 256MiB, config: {SLOW}}}
"""
TEXT = "tenants share the fleet"
TIMEOUT_S = 180.0


def cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tasks.operator.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


#: The tenants' clients, closed while their fleet still runs (`fleet`).
CLIENTS: list[Celery] = []


def tenant_client(env: dict[str, str], name: str) -> Celery:
    """A plain Celery client of tenant `name`, as `gpufleet url --tenant --json` sets it."""
    conf = json.loads(cli(env, "url", "--tenant", name, "--json"))["celery"]
    client = Celery(set_as_current=False)
    client.conf.update(**conf)
    CLIENTS.append(client)
    return client


def new_tenant(env: dict[str, str], name: str, *options: str) -> Celery:
    """Add tenant `name` (`gpufleet tenant add NAME OPTIONS`) and return its client."""
    cli(env, "tenant", "add", name, *options)
    return tenant_client(env, name)


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """The port of the module's fleet's /metrics."""
    return free_port()


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, metrics_port: int
) -> Iterator[tuple[RunningFleet, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("tenants")
    catalog = tmp / "models.yaml"
    catalog.write_text(CATALOG)
    env = fleet_env(GPUFLEET_HOME=str(tmp / "home"))
    args = ["--sim-gpus", "1x4GiB", "--metrics-port", str(metrics_port)]
    with fleet_up(catalog, args, env, log=tmp / "fleet.log") as running:
        running.infer("m", TEXT)  # placed and HOT
        yield running, env
        # the calls' results let go of their subscriptions now, not once Redis is gone
        # (the tenants' clients retry their result store for a while: `caller_conf`)
        gc.collect()
        for client in CLIENTS:
            client.close()


def test_a_new_fleet_on_the_bundled_redis_forgets_the_last_ones_tenants_and_says_so(
    tmp_path: Path,
) -> None:
    catalog = tmp_path / "models.yaml"
    catalog.write_text(CATALOG)
    env = fleet_env(GPUFLEET_HOME=str(tmp_path / "home"))
    args = ["--sim-gpus", "1x4GiB", "--metrics-port", "0"]
    keys = tmp_path / "home" / "default" / "api-keys"
    with fleet_up(catalog, args, env, log=tmp_path / "fleet.log"):
        cli(env, "tenant", "add", "before")
        cli(env, "api-key", "--tenant", "before")
        cli(env, "api-key", "--name", "mine")
        assert json.loads(cli(env, "url", "--tenant", "before", "--json"))["celery"]
    with fleet_up(catalog, args, env, log=tmp_path / "fleet.log"):  # an empty Redis again
        assert json.loads(cli(env, "tenant", "list", "--json")) == []
        refused = subprocess.run(
            [sys.executable, "-m", "tasks.operator.cli", "url", "--tenant", "before"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert refused.returncode != 0 and not refused.stdout
        assert "starts with no tenants" in refused.stderr, refused.stderr
        names = [line.split()[1] for line in keys.read_text().splitlines()]
        assert "tenant:before" not in names and "mine" in names  # a key of its own stays


def call(client: Celery, text: str) -> Any:
    return client.send_task("gpufleet.infer", args=("m", text))


def test_a_tenants_burst_delays_another_tenants_calls_by_about_a_batch_not_the_burst(
    fleet: tuple[RunningFleet, dict[str, str]],
) -> None:
    """Counted in calls, not seconds (a busy 2-core machine stretches seconds; the
    figure in seconds is `bench.fairness`'s): while each of b's calls waits, the worker
    answers about the pass it is running and the one b's call joins, never a's queue."""
    _, env = fleet
    a, b = new_tenant(env, "burst-a"), new_tenant(env, "steady-b")
    call(a, TEXT).get(timeout=TIMEOUT_S)  # the router takes each queue now
    call(b, TEXT).get(timeout=TIMEOUT_S)
    burst = [call(a, f"{i} {TEXT}") for i in range(400)]
    spans = []
    for i in range(20):
        sent = time.time()
        answer = call(b, f"b{i} {TEXT}").get(timeout=TIMEOUT_S)
        assert answer["outputs"]
        spans.append((sent, answer["timings_ms"]["ended_at"] / 1000))
    answers = [c.get(timeout=TIMEOUT_S) for c in burst]
    assert all(answer["outputs"] for answer in answers)
    batch = max(answer["timings_ms"]["batch_calls"] for answer in answers)  # calls a pass held
    done = [answer["timings_ms"]["ended_at"] / 1000 for answer in answers]  # the worker's clock
    ahead = [sum(1 for t in done if sent < t <= end) for sent, end in spans]
    print(f"a's passes held up to {batch} calls; a's answers during each of b's: {ahead}")
    assert ahead[0] < len(burst) // 2  # b's first call did not wait behind the burst
    # the pass it joined and the one running, with room for a job cut into several passes
    assert max(ahead) <= 4 * batch, (ahead, batch)


def test_tenants_flooding_at_once_share_the_first_half_of_the_answers_by_weight(
    fleet: tuple[RunningFleet, dict[str, str]],
) -> None:
    _, env = fleet
    clients = {
        "heavy": new_tenant(env, "heavy", "--weight", "3"),
        "light": new_tenant(env, "light", "--weight", "1"),
    }
    share = weighted(clients["heavy"], clients["light"], 300)["heavy_share"]
    shown = {t["name"]: t for t in json.loads(cli(env, "status", "--json"))["tenants"]}
    assert (shown["heavy"]["weight"], shown["light"]["weight"]) == (3.0, 1.0)
    print(f"heavy's share of the first half of the answers: {share:.3f}")
    assert 0.65 <= share <= 0.85, share


def test_a_tenant_removed_while_its_calls_wait_has_every_one_answered_and_loses_its_user(
    fleet: tuple[RunningFleet, dict[str, str]],
) -> None:
    running, env = fleet
    url = cli(env, "tenant", "add", "leaving").strip()
    client = tenant_client(env, "leaving")
    # its user goes with it: its client reads its answers as the fleet's own user, the
    # one other user that may read them
    client.conf.result_backend = running.fleet_url
    calls = [call(client, f"{i} {TEXT}") for i in range(60)]
    cli(env, "tenant", "remove", "leaving")
    answers = [c.get(timeout=TIMEOUT_S) for c in calls]
    assert all(answer["outputs"] for answer in answers)
    deadline = time.monotonic() + 10
    while True:  # the launcher removes its user within a sync
        try:
            redis.Redis.from_url(url).ping()
        except redis.AuthenticationError:
            break
        except redis.ConnectionError:
            pass  # signed in just before the user went: Redis closes its connections
        assert time.monotonic() < deadline, "the removed tenant's user still signs in"
        time.sleep(0.2)
    assert "leaving" not in cli(env, "tenant", "list")
    assert running.proc.poll() is None


def generate(client: Celery, text: str, tokens: int) -> Any:
    params = {"max_new_tokens": tokens, "temperature": 0}
    return client.send_task("gpufleet.infer", args=("slow", text, params))


def most_at_once(answers: list[dict[str, Any]]) -> int:
    """The most calls running at one moment, from each answer's own start and end."""
    edges = []
    for answer in answers:
        timings = answer["timings_ms"]
        edges += [(timings["started_at"], 1), (timings["ended_at"], -1)]
    running = most = 0
    for _, step in sorted(edges):  # at one instant, ends (-1) before starts
        running += step
        most = max(most, running)
    return most


def test_a_tenant_s_generation_takes_a_row_from_another_tenant_holding_every_one(
    fleet: tuple[RunningFleet, dict[str, str]],
) -> None:
    # 80 calls of tenant a hold all 64 rows of the model, one each; b's call takes one
    # of a's rows at the next step (rows are shared by tenant), so it ends before any of
    # a's calls, which need 120 tokens each; shared by call it waited for one to end
    _, env = fleet
    a, b = new_tenant(env, "rows-a"), new_tenant(env, "rows-b")
    generate(a, "warm", 2).get(timeout=TIMEOUT_S)
    generate(b, "warm", 2).get(timeout=TIMEOUT_S)
    held = [generate(a, f"a story {i}", 120) for i in range(80)]
    time.sleep(1.0)  # a's calls reach the engine and take its rows
    short = generate(b, "a short one", 4).get(timeout=TIMEOUT_S)
    answers = [c.get(timeout=TIMEOUT_S) for c in held]
    first_of_a = min(answer["timings_ms"]["ended_at"] for answer in answers)
    assert short["timings_ms"]["ended_at"] < first_of_a, (short["timings_ms"], first_of_a)


def test_a_tenant_s_running_limit_holds_across_a_burst_and_no_call_fails_for_it(
    fleet: tuple[RunningFleet, dict[str, str]],
) -> None:
    _, env = fleet
    client = new_tenant(env, "capped", "--max-running", "2")
    warm = generate(client, "warm", 2).get(timeout=TIMEOUT_S)  # the router takes its queue
    calls = [generate(client, f"story number {i}", 24) for i in range(12)]
    answers = [c.get(timeout=TIMEOUT_S) for c in calls]
    assert all(len(a["outputs"]["tokens"][0]) == 24 for a in answers)
    assert most_at_once(answers) == 2  # as many as it may, never more
    time.sleep(0.5)  # each call is counted after its answer is stored
    shown = {t["name"]: t for t in json.loads(cli(env, "status", "--json"))["tenants"]}
    capped = shown["capped"]
    assert capped["max_running"] == 2
    assert (capped["let_in"], capped["parked"]) == (0, 0)  # every slot freed
    # its usage, counted by the GPU worker, against what its answers say
    answers.append(warm)
    outputs = [a["outputs"] for a in answers]
    assert (capped["calls"], capped["failed"]) == (13, 0), json.dumps(capped)
    assert capped["tokens_out"] == sum(len(o["tokens"][0]) for o in outputs) == 12 * 24 + 2
    assert capped["tokens_in"] == sum(sum(o["prompt_tokens"]) for o in outputs)
    computed = sum(a["timings_ms"]["compute"] for a in answers) / 1000
    assert 0 < capped["gpu_seconds"] <= computed + 0.01
    cli(env, "tenant", "set", "capped", "--max-running", "3", "--weight", "2")
    rows = {r["name"]: r for r in json.loads(cli(env, "tenant", "list", "--json"))}
    assert (rows["capped"]["max_running"], rows["capped"]["weight"]) == (3, 2.0)


def test_calls_past_a_tenant_s_max_queued_are_refused_at_once_and_the_rest_answered(
    fleet: tuple[RunningFleet, dict[str, str]],
) -> None:
    _, env = fleet
    client = new_tenant(env, "bounded", "--max-running", "1", "--max-queued", "3")
    generate(client, "warm", 2).get(timeout=TIMEOUT_S)
    until("the warm call's slot freed", lambda: _let_in(env, "bounded") == 0)
    long = generate(client, "a long story", 500)  # holds the one running slot
    until("the long call holding its slot", lambda: _let_in(env, "bounded") == 1)
    sent = time.monotonic()
    calls = [generate(client, f"short {i}", 4) for i in range(8)]
    until("five calls refused", lambda: sum(c.failed() for c in calls) >= 5)
    refused_after = time.monotonic() - sent
    assert not long.ready(), "refused only after the long call ended"
    refused, answered = [], []
    for handle in calls:
        try:
            answered.append(handle.get(timeout=TIMEOUT_S))
        except Exception as exc:
            refused.append((type(exc).__name__, str(exc)))
    assert long.get(timeout=TIMEOUT_S)["outputs"]["tokens"]
    assert [name for name, _ in refused] == ["QuotaError"] * 5, refused
    assert "--max-queued" in refused[0][1]
    assert len(answered) == 3 and all(a["outputs"]["tokens"] for a in answered)
    print(f"5 calls refused {refused_after:.2f} s after they were sent, the long call running")


def _let_in(env: dict[str, str], name: str) -> int:
    rows = json.loads(cli(env, "tenant", "list", "--json"))
    return int(next(r["let_in"] for r in rows if r["name"] == name))


def test_a_tenant_cannot_read_hear_stream_or_cancel_another_tenants_call_knowing_its_id(
    fleet: tuple[RunningFleet, dict[str, str]],
) -> None:
    running, env = fleet
    nosy, private = new_tenant(env, "nosy"), new_tenant(env, "private")
    nosy_url = cli(env, "url", "--tenant", "nosy").strip()
    shared = "same-id-for-both"  # the other tenant's id, in nosy's hands
    params = {"max_new_tokens": 200, "temperature": 0, "stream": True}
    theirs = private.send_task("gpufleet.infer", args=("slow", "a secret", params), task_id=shared)
    snoop = redis.Redis.from_url(nosy_url)
    stream = f"t.private.gpufleet-stream-{shared}"
    until("private's call streaming", lambda: running.inside.backend.client.exists(stream))
    for act in (
        lambda: snoop.xread({stream: "0-0"}),  # its streamed text
        lambda: heard(snoop, f"t.private.celery-task-meta-{shared}"),  # its result's news
        lambda: snoop.get(f"celery-task-meta-{shared}"),  # the default tenant's results
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            act()
    # nosy's cancel of that id, and its own call of the same id, reach only nosy's call
    mine = nosy.send_task("gpufleet.infer", args=("m", TEXT), task_id=shared)
    assert mine.get(timeout=TIMEOUT_S)["outputs"]
    assert nosy.send_task("gpufleet.cancel", args=(shared,)).get(timeout=TIMEOUT_S) is False
    answer = theirs.get(timeout=TIMEOUT_S)  # neither revoked nor answered by nosy's calls
    assert len(answer["outputs"]["tokens"][0]) == 200
    with pytest.raises(redis.exceptions.NoPermissionError):
        snoop.get(f"t.private.celery-task-meta-{shared}")  # stored, and still refused
    assert (
        json.loads(private.backend.client.get(f"t.private.celery-task-meta-{shared}"))["task_id"]
        == shared
    )
    # a chain of nosy's: each step its own call, answered where its client reads
    from celery import chain

    steps = chain(
        nosy.signature("gpufleet.infer", args=("m", TEXT)),
        nosy.signature("gpufleet.status", immutable=True),
    ).apply_async()
    assert "tenants" in steps.get(timeout=TIMEOUT_S)
    assert steps.parent.get(timeout=TIMEOUT_S)["outputs"]
    snoop.close()


def test_every_metric_the_grafana_dashboard_queries_is_one_the_fleet_s_metrics_page_serves(
    fleet: tuple[RunningFleet, dict[str, str]], metrics_port: int
) -> None:
    """deploy/grafana/gpufleet.json against the real /metrics of the module's fleet, once it
    has a tenant and a generating call (a family appears with its first sample: the
    generation histograms with a model's first generating call)."""
    _, env = fleet
    generate(new_tenant(env, "charted"), "a call the dashboard charts", 4).get(timeout=TIMEOUT_S)

    def page() -> str:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as response:
            text: str = response.read().decode()
            return text

    # the GPU worker records a call's figures as it ends, a moment after its answer
    counted = "gpufleet_time_to_first_token_seconds_count"
    until("the generating call's figures are served", lambda: counted in served_names(page()))
    text = page()
    assert "gpufleet_up 1.0" in text.splitlines()
    missing = missing_from(text)
    print("metrics the dashboard queries that /metrics does not serve:", missing or "none")
    assert not missing, f"the dashboard queries metrics the fleet does not serve: {missing}"
