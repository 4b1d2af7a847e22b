"""The HTTP front's parts that need no fleet: its key file, OpenAI's shapes, its messages."""

from __future__ import annotations

import asyncio
import base64
import os
import struct
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import redis.asyncio
from celery import Celery

from placement.catalog.catalog import Catalog
from placement.errors import ConfigError
from placement.server.redis_server import RedisServer
from placement.server.tenant_users import save_passwords
from tasks.config import caller_conf
from tasks.front import keys, server, shapes
from tasks.front.keys import KeyFile
from tasks.front.sending import Sender, message
from tasks.front.server import Front
from tasks.front.shapes import RequestError
from tasks.front.waiting import Stream

CHAT: Any = [{"role": "user", "content": "hi"}]
PARTS = [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]
IMAGE = [{"role": "user", "content": [{"type": "image_url"}]}]
REPO = Path(__file__).resolve().parents[1]


def test_a_key_file_holds_digests_only_and_takes_a_key_added_after_it_was_read(
    tmp_path: Path,
) -> None:
    path = tmp_path / "api-keys"
    first, second = keys.new_key(), keys.new_key()
    keys.add(path, first, "first")
    known = KeyFile(path)
    assert known.name_of(first) == "first"
    assert known.name_of(second) is None
    keys.add(path, second, "second")
    assert known.name_of(second) == "second"
    text = path.read_text()
    assert first not in text and second not in text
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_replacing_the_up_key_revokes_the_old_one_and_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "api-keys"
    mine, old_up, new_up = keys.new_key(), keys.new_key(), keys.new_key()
    keys.add(path, mine, "mine")
    keys.replace_key(path, old_up, keys.UP_KEY_NAME)
    keys.replace_key(path, new_up, keys.UP_KEY_NAME)
    known = KeyFile(path)
    assert known.name_of(mine) == "mine"
    assert known.name_of(new_up) == keys.UP_KEY_NAME
    assert known.name_of(old_up) is None
    assert len(known) == 2


def test_a_malformed_or_missing_key_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gpufleet api-key"):
        len(KeyFile(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.write_text("# a comment\nmy-plain-key\n")
    with pytest.raises(ConfigError, match=r"bad:2: write `sha256:"):
        len(KeyFile(bad))


def test_a_chat_becomes_a_fleet_chat_with_openai_s_defaults_and_names() -> None:
    call = shapes.chat_call(
        {
            "model": "talker",
            "messages": [
                {"role": "developer", "content": PARTS},
                {"role": "user", "content": "hi", "name": "ann"},
            ],
            "max_tokens": 99,
            "max_completion_tokens": 7,
            "stop": "\n",
            "user": "someone",
            "n": 1,
        }
    )  # fmt: skip
    assert call.inputs == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    # max_completion_tokens wins; temperature is OpenAI's 1 when unsaid; `user` stays out
    assert call.params == {"max_new_tokens": 7, "temperature": 1.0, "stop": ("\n",)}
    unsaid = shapes.chat_call({"model": "talker", "messages": CHAT})
    assert unsaid.params["max_new_tokens"] is None  # as many as the model holds
    legacy = shapes.completion_call({"model": "talker", "prompt": ["a", "b"]})
    assert legacy.params["max_new_tokens"] == shapes.COMPLETION_MAX_TOKENS


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"n": 3}, "n", "n=3"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"guided_json": {}}, "guided_json", "unrecognized request argument"),
        ({"top_p": 0}, "top_p", "above 0"),
        ({"max_tokens": 0}, "max_tokens", "'max_tokens'"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
        ({"messages": []}, "messages", "non-empty"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "use one of"),
        ({"messages": IMAGE}, "messages[0].content", "text parts"),
        ({"model": 7}, "model", "model's name"),
    ],
)  # fmt: skip
def test_a_chat_field_the_fleet_cannot_honour_is_refused_by_name(
    body: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(RequestError, match=words) as caught:
        shapes.chat_call({"model": "talker", "messages": CHAT, **body})
    assert caught.value.param == param


def test_an_embedding_in_base64_decodes_to_the_floats_it_carries() -> None:
    call = shapes.embedding_call({"model": "minilm", "input": "x", "encoding_format": "base64"})
    rows = [[0.25, -1.5, 3.0e-7], [1.0, 2.0, 3.0]]
    body = shapes.embeddings(call, {"embeddings": rows, "dim": 3, "tokens": 4})
    packed = base64.b64decode(body["data"][1]["embedding"])
    assert list(struct.unpack("<3f", packed)) == pytest.approx(rows[1])
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    with pytest.raises(RequestError, match="token ids are not taken"):
        shapes.embedding_call({"model": "minilm", "input": [[1, 2, 3]]})


def test_a_fleet_that_cannot_take_a_call_now_says_when_to_try_again() -> None:
    full = shapes.failure("CantAccommodateError", "no room")
    assert (full.status, full.headers()) == (503, {"Retry-After": "5"})
    bad = shapes.failure("PayloadError", "bad")
    assert (bad.status, bad.headers()) == (400, {})
    crashed = shapes.failure("RuntimeError", "CUDA error")  # the model's, not the client's
    assert crashed.status == 500 and crashed.body()["error"]["type"] == "server_error"


def test_a_stream_waiter_cancelled_as_its_text_arrives_loses_none_of_it() -> None:
    async def run() -> list[tuple[int, str]]:
        stream = Stream("call")
        waiter = asyncio.ensure_future(stream.arrived())
        await asyncio.sleep(0)
        stream.put("1-0", {"start": "1"})
        stream.put("1-1", {"i": "0", "t": "ab"})
        waiter.cancel()  # woken and cancelled in one turn, as when the call ends first
        stream.put("1-2", {"i": "0", "t": "c"})
        return stream.drain()

    assert asyncio.run(run()) == [(0, "ab"), (0, "c")]


def test_a_stream_whose_call_ran_again_with_other_text_breaks_and_keeps_what_it_gave() -> None:
    async def run() -> tuple[list[tuple[int, str]], bool]:
        stream = Stream("call")
        for entry_id, fields in [
            ("1-0", {"start": "1"}),
            ("1-1", {"i": "0", "t": "ab"}),
            ("1-2", {"start": "1"}),  # its worker was lost: the call runs again
            ("1-3", {"i": "0", "t": "xy"}),  # sampled without a seed: other text
            ("1-4", {"i": "0", "t": "z"}),
        ]:
            stream.put(entry_id, fields)
        return stream.drain(), stream.broken

    assert asyncio.run(run()) == ([(0, "ab")], True)


def test_the_front_s_message_is_the_one_celery_pushes_for_the_same_call_but_its_tag(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = Celery(set_as_current=False)
    app.conf.update(**caller_conf(redis_url))  # a plain Celery client's transport
    queue = f"front-test-{os.getpid()}"
    args = ["minilm", ["two", "texts"], {"normalize": True, "stream": False}]
    try:
        # as `tasks.api.infer.apply_async((model, inputs, params))` sends it
        app.send_task(
            "gpufleet.infer", tuple(args), task_id="call-1", queue=queue, ignore_result=False
        )
        sent = orjson.loads(redis_client.lpop(queue) or "")
    finally:
        redis_client.delete(queue)
        app.close()
    ours = orjson.loads(message(app, "gpufleet.infer", "call-1", args, queue))
    for one in (sent, ours):
        tag = one["properties"].pop("delivery_tag")
        assert isinstance(tag, str) and len(tag) == 36  # a fresh uuid each
        one["body"] = orjson.loads(base64.b64decode(one["body"]))
    assert ours["body"] == [args, {}, {"callbacks": None, "errbacks": None, "chain": None,
                                       "chord": None}]  # fmt: skip
    assert ours == sent


def test_more_calls_sent_at_once_than_the_client_has_connections_all_reach_the_queue(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = Celery(set_as_current=False)
    queue = f"front-test-many-{os.getpid()}"

    async def send_all() -> None:
        client = redis.asyncio.Redis.from_url(redis_url, max_connections=4)
        sender = Sender(app, client, queue=queue, pushes=4)
        try:
            await asyncio.gather(
                *(sender.send("gpufleet.infer", f"call-{i}", ["m", "x", {}]) for i in range(200))
            )
        finally:
            await client.aclose()

    try:
        asyncio.run(send_all())
        ids = {orjson.loads(m)["headers"]["id"] for m in redis_client.lrange(queue, 0, -1)}
    finally:
        redis_client.delete(queue)
        app.close()
    assert ids == {f"call-{i}" for i in range(200)}


def test_a_call_sent_after_redis_restarted_reaches_it_on_a_new_connection() -> None:
    app = Celery(set_as_current=False)

    async def send_around_a_restart(server: RedisServer) -> None:
        client = redis.asyncio.Redis.from_url(server.url)
        sender = Sender(app, client, queue="calls")
        try:
            await sender.send("gpufleet.infer", "before", ["m", "x", {}])
            server.restart()  # the client's pooled connection is closed by the server
            await sender.send("gpufleet.infer", "after", ["m", "x", {}])
        finally:
            await client.aclose()

    with RedisServer() as server:
        asyncio.run(send_around_a_restart(server))
        client = redis.Redis.from_url(server.url)
        ids = [orjson.loads(m)["headers"]["id"] for m in client.lrange("calls", 0, -1)]
        client.close()
    app.close()
    assert "after" in ids


def test_a_tenant_whose_password_changed_gets_a_new_lane_without_waiting_for_the_old_to_stop(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The old lane's stop waits for the cancels it sent; here one never lands, and the
    # deadline is an hour: a replacing call that waited for it would not return.
    monkeypatch.setattr(server, "CANCELS_DEADLINE_S", 3600.0)
    passwords = tmp_path / "passwords.json"
    save_passwords(passwords, {"acme": "first", "other": "theirs"})
    front = Front(
        Catalog.load(REPO / "models.yaml"), KeyFile(tmp_path / "keys"), redis_url, redis_url,
        passwords,
    )  # fmt: skip

    async def replace() -> tuple[server.Lane, server.Lane, server.Lane, bool]:
        landed = asyncio.Event()
        old = await front.lane("acme")

        async def cancel() -> None:  # a cancel sent as a client left, not landed yet
            await landed.wait()

        server._keep(old.cancels, asyncio.create_task(cancel()))
        save_passwords(passwords, {"acme": "second one", "other": "theirs"})
        new = await asyncio.wait_for(front.lane("acme"), timeout=30)
        other = await asyncio.wait_for(front.lane("other"), timeout=30)
        old_still_stopping = bool(front._retiring)
        landed.set()
        await asyncio.wait_for(front.stop(), timeout=30)
        return old, new, other, old_still_stopping

    old, new, other, old_still_stopping = asyncio.run(replace())
    assert new is not old and new.password == "second one"
    assert other.tenant == "other"
    assert old_still_stopping  # the old lane was stopping all along, in the background
    assert not front._retiring  # and the front's stop waited for it
