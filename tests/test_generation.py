"""Text generation in one process: the continuous batch, sampling, chats, stop strings,
streamed text and the KV-cache budget (`worker.generation`), on real synthetic GPT-2 models.

The references are transformers' own `generate` and each call run alone; nothing is mocked.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from placement.catalog.catalog import Catalog, ModelSpec
from placement.errors import CatalogError, PayloadError
from tests.paces import Fixed, Unpaced
from worker import handlers
from worker.generation import params as gen_params
from worker.generation.engine import Engine, Options, Sequence_
from worker.generation.pacing import LEAST_TOKENS, Pace
from worker.generation.replica import replica_engine
from worker.generation.sampling import Choice
from worker.generation.serving import Driver, GenCall, Generated, run_calls
from worker.generation.text import Detokenizer
from worker.weights.synthetic import build_synthetic

CPU = torch.device("cpu")
CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 256}
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


def _spec(name: str = "gen", **fields: Any) -> ModelSpec:
    entry = {"source": "synthetic", "task": "text-generation", "memory": "64MiB"}
    entry["config"] = {**CONFIG, "vocab_size": 512}
    entry.update(fields)
    return Catalog.from_mapping({"models": {name: entry}})[name]


@pytest.fixture(scope="module")
def model() -> tuple[Any, Any]:
    return build_synthetic(_spec())


def _engine(
    model: tuple[Any, Any], budget: int = 10**6, rows: int = 64, *, paged: bool = True
) -> Engine:
    net, tokenizer = model
    return Engine(net, tokenizer, CPU, budget=budget, window=256, max_rows=rows, paged_cache=paged)


def _most_rows(engine: Engine, each_step: Callable[[], None] = lambda: None) -> int:
    """Step `engine` until it is idle; the most rows a step held (`each_step` after each)."""
    most = 0
    while engine.busy:
        engine.step()
        most = max(most, len(engine.rows))
        each_step()
    return most


def _prompts(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([2, *(rng.randrange(5, 512) for _ in range(rng.randrange(3, 60)))], rng.randrange(4, 48))
        for _ in range(count)
    ]


def _alone(model: tuple[Any, Any], prompt: list[int], options: Options) -> list[int]:
    engine = _engine(model)
    sequence = Sequence_("alone", prompt, options)
    engine.add(sequence)
    engine.run()
    return sequence.tokens


def test_greedy_calls_that_join_and_leave_a_running_batch_get_the_tokens_they_get_alone(
    model: tuple[Any, Any],
) -> None:
    prompts = _prompts(20)
    rng = random.Random(1)
    engine = _engine(model)
    sequences: dict[int, Sequence_] = {}
    pending = list(range(len(prompts)))
    joined_late = False
    while pending or engine.busy:
        for _ in range(rng.randrange(0, 3)):  # calls arrive while others run
            if pending:
                index = pending.pop(0)
                joined_late |= bool(engine.rows)
                prompt, new = prompts[index]
                sequences[index] = Sequence_(index, prompt, Options(max_new_tokens=new))
                engine.add(sequences[index])
        engine.step()
    assert joined_late
    for index, (prompt, new) in enumerate(prompts):
        assert sequences[index].tokens == _alone(model, prompt, Options(max_new_tokens=new))
        assert sequences[index].finish in ("length", "stop")


def test_a_call_alone_gets_what_transformers_generate_gives(model: tuple[Any, Any]) -> None:
    net, _ = model
    prompt, new = _prompts(1, seed=5)[0]
    mine = _alone(model, prompt, Options(max_new_tokens=new))
    theirs = net.generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    eos = net.generation_config.eos_token_id
    assert mine == (theirs[: theirs.index(eos) + 1] if eos in theirs else theirs)


def test_the_repetition_penalty_follows_transformers_rule(model: tuple[Any, Any]) -> None:
    net, _ = model
    prompt = [2, 9, 9, 9, 40, 41, 9, 9]
    options = Options(max_new_tokens=30, choice=Choice(repetition_penalty=1.8))
    theirs = net.generate(
        torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0,
        repetition_penalty=1.8,
    )[0, len(prompt) :].tolist()  # fmt: skip
    eos = net.generation_config.eos_token_id
    assert _alone(model, prompt, options) == (
        theirs[: theirs.index(eos) + 1] if eos in theirs else theirs
    )
    assert _alone(model, prompt, options) != _alone(model, prompt, Options(max_new_tokens=30))


def test_a_seed_gives_the_same_sampled_tokens_whatever_shares_the_batch(
    model: tuple[Any, Any],
) -> None:
    prompt = [2, 70, 71, 72, 73]
    sampled = Options(max_new_tokens=40, choice=Choice(temperature=1.3), seed=7)
    alone = _alone(model, prompt, sampled)
    engine = _engine(model)
    crowd = [Sequence_(i, p, Options(max_new_tokens=n)) for i, (p, n) in enumerate(_prompts(6))]
    mine = Sequence_("mine", prompt, sampled)
    for sequence in [*crowd[:3], mine, *crowd[3:]]:
        engine.add(sequence)
    engine.run()
    assert mine.tokens == alone
    other_seed = _alone(model, prompt, Options(40, Choice(temperature=1.3), seed=8))
    assert other_seed != alone
    greedy = _alone(model, prompt, Options(max_new_tokens=40))
    assert alone != greedy  # it did sample


@pytest.mark.parametrize(
    "choice",
    [Choice(temperature=1.5, top_k=1), Choice(temperature=1.5, top_p=1e-6)],
    ids=["top-k-1", "tiny-top-p"],
)
def test_top_k_of_one_or_a_tiny_top_p_samples_only_the_best_token(
    model: tuple[Any, Any], choice: Choice
) -> None:
    prompt = [2, 11, 12, 13]
    narrowed = _alone(model, prompt, Options(max_new_tokens=30, choice=choice, seed=3))
    assert narrowed == _alone(model, prompt, Options(max_new_tokens=30))


def test_a_stop_string_ends_the_text_before_it_and_the_tokens_with_the_one_that_made_it(
    model: tuple[Any, Any],
) -> None:
    _, tokenizer = model
    prompt = [2, *tokenizer.encode("hello there", add_special_tokens=False)]
    full = _alone(model, prompt, Options(max_new_tokens=40))
    text = tokenizer.decode(full, skip_special_tokens=True)
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    cut = text.index(stop)
    engine = _engine(model)
    pieces: list[str] = []
    sequence = Sequence_("s", prompt, Options(max_new_tokens=40, stop=(stop,)), pieces.append)
    engine.add(sequence)
    engine.run()
    assert sequence.finish == "stop"
    assert sequence.text is not None and sequence.text.text == text[:cut]
    assert "".join(pieces) == text[:cut]
    assert full[: len(sequence.tokens)] == sequence.tokens
    assert stop in tokenizer.decode(sequence.tokens, skip_special_tokens=True)
    assert stop not in tokenizer.decode(sequence.tokens[:-1], skip_special_tokens=True)


def test_streamed_pieces_join_into_the_final_text_and_hold_back_a_possible_stop() -> None:
    class Chars:  # one character per token
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(i) for i in ids)

    text = Detokenizer(Chars(), ["STOP"])
    pieces = []
    for i in range(1, 10):
        text.update([ord(c) for c in "abcSTxyST"[:i]])
        pieces.append(text.delta())
    assert pieces[3:5] == ["", ""]  # "S", "ST": could begin "STOP"
    assert "".join(pieces) + text.delta(final=True) == "abcSTxyST"
    assert "".join(pieces).endswith("STxy")  # released once "STx" could no longer stop


def test_a_chat_is_rendered_by_the_catalog_template_and_a_model_without_one_refuses_chats(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with_template = replica_engine(net, tokenizer, _spec(chat_template=TEMPLATE), CPU)
    [answer] = run_calls(with_template, [GenCall("c", chat, {"max_new_tokens": 5})], TEMPLATE)
    assert isinstance(answer, Generated)
    rendered = "<system>be brief\n<user>hi\n<assistant>"
    plain = _alone(model, tokenizer.encode(rendered, add_special_tokens=False), Options(5))
    assert answer.outputs["tokens"] == [plain]
    [refused] = run_calls(_engine(model), [GenCall("c", chat, None)], None)
    assert isinstance(refused, PayloadError)
    assert "no chat template" in str(refused) and "chat_template" in str(refused)


@pytest.mark.parametrize(
    ("inputs", "params", "fragments"),
    [
        ("x", {"temperature": -0.5}, ["'temperature'", "from 0 to 2", "0 is greedy"]),
        ("x", {"temperature": "hot"}, ["'temperature'", "a number", "'hot'"]),
        ("x", {"top_p": 0}, ["'top_p'", "above 0 to 1"]),
        ("x", {"top_k": 1.5}, ["'top_k'", "whole number"]),
        ("x", {"repetition_penalty": 11}, ["'repetition_penalty'", "from 0.01 to 10"]),
        ("x", {"seed": -1}, ["'seed'", "or null"]),
        ("x", {"stop": ["a"] * 9}, ["'stop'", "up to 8 strings"]),
        ("x", {"stop": [""]}, ["'stop'", "1 to 64 characters"]),
        ("x", {"stream": "yes"}, ["'stream'", "true or false"]),
        ("x", {"max_new_tokens": 513}, ["'max_new_tokens'", "from 1 to 512"]),
        (
            [{"role": "robot", "content": "hi"}],
            None,
            ["inputs[0]'s role", "system, user, assistant"],
        ),
        ([{"role": "user", "content": 3}], None, ["inputs[0]'s content must be a string"]),
        ([{"role": "user"}], None, ["inputs[0] must be a message"]),
        ([{"role": "user", "content": "x"}] * 65, None, ["65 messages", "limit of 64"]),
    ],
)
def test_a_bad_generation_call_gets_a_payload_error_that_says_what_is_allowed(
    inputs: Any, params: Any, fragments: list[str]
) -> None:
    with pytest.raises(PayloadError) as caught:
        handlers.validate("text-generation", inputs, params)
    for fragment in fragments:
        assert fragment in str(caught.value), (fragment, str(caught.value))


def test_generation_params_are_checked_with_their_defaults_filled_in() -> None:
    prompts, options = gen_params.validate("hi", {"temperature": 1, "stop": "END"})
    assert prompts == ["hi"]
    assert options["temperature"] == 1.0 and isinstance(options["temperature"], float)
    assert options["stop"] == ("END",)
    assert options["max_new_tokens"] == gen_params.PARAMS["max_new_tokens"].default
    assert options["seed"] is None


def test_a_left_padded_batch_waits_for_room_in_the_kv_budget_and_never_holds_more(
    model: tuple[Any, Any],
) -> None:
    prompt, new = [2, *range(10, 50)], 60  # a reach of 101 positions each
    budget = 2 * 101 + 50  # room for two such calls at once, not three
    engine = _engine(model, budget=budget, paged=False)
    calls = [Sequence_(i, prompt, Options(max_new_tokens=new)) for i in range(5)]
    for sequence in calls:
        engine.add(sequence)

    def within_budget() -> None:
        assert engine.capacity_tokens <= budget

    assert _most_rows(engine, within_budget) == 2
    assert all(s.finish == "length" and len(s.tokens) == new for s in calls)
    assert engine.peak_tokens <= budget
    assert calls[4].tokens == calls[0].tokens  # waiting changed nothing


def test_a_call_that_could_never_fit_is_refused_at_once(model: tuple[Any, Any]) -> None:
    engine = _engine(model, budget=100)
    with pytest.raises(PayloadError, match="KV-cache budget of 100 tokens"):
        engine.add(Sequence_(0, [2] * 60, Options(max_new_tokens=50)))
    with pytest.raises(PayloadError, match="holds 256 positions"):
        _engine(model).add(Sequence_(0, [2] * 250, Options(max_new_tokens=10)))
    assert not engine.busy


def test_a_cancelled_call_ends_at_the_next_step_and_frees_its_row(model: tuple[Any, Any]) -> None:
    engine = _engine(model)
    keep = Sequence_("keep", [2, 30, 31], Options(max_new_tokens=40))
    stop = Sequence_("stop", [2, 40, 41, 42], Options(max_new_tokens=40))
    engine.add(keep)
    engine.add(stop)
    engine.step()  # the prompts' pass makes a first token, a decode step the second
    engine.step()
    engine.cancel("stop")
    ended = engine.step()
    assert stop in ended and stop.finish == "cancelled" and len(stop.tokens) == 3
    assert engine.rows == [keep]
    engine.run()
    assert keep.tokens == _alone(model, [2, 30, 31], Options(max_new_tokens=40))


def test_a_generation_model_s_reservation_holds_its_kv_budget_in_bytes() -> None:
    spec = _spec(kv_cache={"tokens": 1000})
    budget = spec.kv_budget()
    assert budget is not None
    per_token = 2 * CONFIG["n_layer"] * CONFIG["n_embd"] * 4  # keys and values, float32
    assert (budget.tokens, budget.per_token) == (1000, per_token)
    assert spec.demand().kv_cache == 1000 * per_token
    default = _spec().kv_budget()
    assert default is not None and default.tokens == 8 * CONFIG["n_positions"]
    in_bytes = _spec(kv_cache="1MiB").kv_budget()
    assert in_bytes is not None and in_bytes.tokens == 2**20 // per_token
    forward = {"source": "synthetic", "task": "forward", "memory": "1MiB", "kv_cache": "1MiB"}
    with pytest.raises(CatalogError, match="only a text-generation model has a KV cache"):
        Catalog.from_mapping({"models": {"e": forward}})


def test_a_cancelled_call_stops_every_prompt_and_the_others_run_on(
    model: tuple[Any, Any],
) -> None:
    outcomes: dict[str, Any] = {}
    driver = Driver(_engine(model), None, lambda call, out: outcomes.__setitem__(call.key, out))
    driver.add(
        [
            GenCall("a", "first call", {"max_new_tokens": 30}),
            GenCall("b", ["second", "call"], {"max_new_tokens": 30}),
        ]
    )
    steps = 0
    while driver.busy:
        driver.step()
        steps += 1
        if steps == 3:
            driver.cancel("b")
    stopped, whole = outcomes["b"], outcomes["a"]
    assert isinstance(stopped, Generated) and stopped.cancelled
    assert stopped.outputs["finish_reasons"] == ["cancelled", "cancelled"]
    assert all(len(tokens) < 30 for tokens in stopped.outputs["tokens"])
    assert isinstance(whole, Generated) and not whole.cancelled
    assert len(whole.outputs["tokens"][0]) == 30 or whole.outputs["finish_reasons"] == ["stop"]


def test_the_padded_cache_never_grows_past_the_budget_when_a_long_prompt_joins_a_shrunk_batch(
    model: tuple[Any, Any],
) -> None:
    budget = 1000
    engine = _engine(model, budget=budget, paged=False)
    for i in range(31):  # 31 short rows, then 30 of them leave
        engine.add(Sequence_(i, [2, 7, 8, 9, 10], Options(max_new_tokens=20 if i == 0 else 10)))
    long, added, buffers = None, False, set()
    while engine.busy:
        engine.step()
        assert engine.capacity_tokens <= budget
        if engine.rows:
            buffers.add(engine._cache.layers[0]._k.data_ptr())
        if not added and len(engine.rows) == 1:
            long = Sequence_("long", [2] + [11] * 199, Options(max_new_tokens=50))
            engine.add(long)
            added = True
    assert long is not None and long.tokens == _alone(model, long.prompt, Options(50))
    assert len(buffers) < 8  # the buffers grew a few times, not at every step


def test_a_temperature_too_small_for_float32_is_greedy_and_fails_no_call(
    model: tuple[Any, Any],
) -> None:
    prompt = [2, 50, 51, 52]
    tiny = Options(max_new_tokens=20, choice=Choice(temperature=1e-40), seed=1)
    assert _alone(model, prompt, tiny) == _alone(model, prompt, Options(max_new_tokens=20))


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"repetition_penalty": 0.001}, "from 0.01 to 10"),
        ({"temperature": 10**400}, "from 0 to 2"),
        ({"seed": 2**70}, "or null"),
    ],
)
def test_numbers_out_of_range_however_large_get_a_payload_error(
    params: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(PayloadError, match=fragment):
        gen_params.validate("x", params)


def test_a_model_with_sliding_window_layers_runs_its_calls_one_at_a_time_correctly() -> None:
    config = {
        "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "max_position_embeddings": 256, "sliding_window": 16,
    }  # fmt: skip
    entry = {"source": "synthetic", "task": "text-generation", "memory": "64MiB"}
    spec = Catalog.from_mapping({"models": {"slide": {**entry, "config": config}}})["slide"]
    net, tokenizer = build_synthetic(spec)
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=256)
    calls = [Sequence_(i, [2] + [7] * (3 + 9 * i), Options(max_new_tokens=5 + i)) for i in range(4)]
    for sequence in calls:
        engine.add(sequence)
    assert _most_rows(engine) == 1
    for sequence in calls:
        alone = Engine(net, tokenizer, CPU, budget=10**6, window=256)
        again = Sequence_("a", sequence.prompt, sequence.options)
        alone.add(again)
        alone.run()
        assert (
            sequence.tokens == again.tokens and len(again.tokens) == sequence.options.max_new_tokens
        )


def test_prompts_prefilled_in_one_padded_pass_still_get_the_tokens_they_get_alone(
    model: tuple[Any, Any],
) -> None:
    class Counting(Engine):
        passes: ClassVar[list[int]] = []

        def _prefill_group(self, chunks: list[tuple[Sequence_, int]]) -> int:
            self.passes.append(len(chunks))
            return super()._prefill_group(chunks)

    net, tokenizer = model
    prompts = _prompts(12, seed=9)
    for merge, most_passes in ((True, 1), (False, 12)):
        Counting.passes = []
        engine = Counting(net, tokenizer, CPU, budget=10**6, window=256, merge_prefill=merge)
        calls = [Sequence_(i, p, Options(max_new_tokens=n)) for i, (p, n) in enumerate(prompts)]
        for sequence in calls:
            engine.add(sequence)
        engine.run()
        assert 1 <= len(Counting.passes) <= most_passes
        for sequence, (prompt, new) in zip(calls, prompts, strict=True):
            assert sequence.tokens == _alone(model, prompt, Options(max_new_tokens=new))
    assert len(Counting.passes) > 1  # lengths from 4 to 60: more than one pass on a CPU


def test_a_step_admits_prompts_up_to_its_prefill_budget_and_streams_them_before_decoding(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    engine = Engine(
        net, tokenizer, CPU, budget=10**6, window=256, prefill_tokens=45, pace=Unpaced()
    )
    texts: list[str] = []
    calls = [
        Sequence_(i, [2] + [7 + i] * 14, Options(max_new_tokens=4), on_text=texts.append)
        for i in range(5)
    ]  # 15 tokens each: three fit in 45
    for sequence in calls:
        engine.add(sequence)
    seen: list[list[int]] = []  # tokens each running row held when the hook ran
    engine.after_prefill = lambda: seen.append([len(s.tokens) for s in engine.rows])
    engine.step()
    assert seen == [[1, 1, 1]] and len(engine.waiting) == 2
    assert [len(s.tokens) for s in engine.rows] == [2, 2, 2]  # then it decoded
    engine.step()
    assert seen[1] == [2, 2, 2, 1, 1]


class _Tight(Engine):
    """An engine on a device with room for prefill passes of at most `room` tokens."""

    room = 0
    passes: ClassVar[list[int]] = []

    def _forward_prompts(
        self, ids: torch.Tensor, mask: torch.Tensor, p: torch.Tensor, cache: Any = None
    ) -> Any:
        if ids.numel() > self.room:
            raise torch.OutOfMemoryError(f"{ids.numel()} tokens do not fit {self.room}")
        self.passes.append(int(ids.shape[0]))
        return super()._forward_prompts(ids, mask, p, cache)


def test_a_prefill_pass_that_runs_out_of_memory_runs_in_halves_with_the_same_tokens(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    prompts = [([2] + [9 + i] * 19, 6) for i in range(8)]  # 20 tokens each
    _Tight.room, _Tight.passes = 45, []  # two prompts a pass
    engine = _Tight(net, tokenizer, CPU, budget=10**6, window=256, merge_prefill=True)
    calls = [Sequence_(i, p, Options(max_new_tokens=n)) for i, (p, n) in enumerate(prompts)]
    for sequence in calls:
        engine.add(sequence)
    engine.run()
    assert _Tight.passes == [2, 2, 2, 2]  # 8 did not fit, nor 4: halved twice
    assert engine.prefill_tokens == 40  # half the 80 padded tokens that did not fit last
    for sequence, (prompt, new) in zip(calls, prompts, strict=True):
        assert sequence.tokens == _alone(model, prompt, Options(max_new_tokens=new))
    _Tight.room = 10
    lone = _Tight(net, tokenizer, CPU, budget=10**6, window=256)
    lone.add(Sequence_("x", prompts[0][0], Options(max_new_tokens=2)))
    with pytest.raises(torch.OutOfMemoryError):  # one prompt that never fits fails as before
        lone.step()


def test_a_row_whose_scores_overflow_keeps_its_best_token_and_the_others_sample() -> None:
    from worker.generation.sampling import Columns, pick

    logits = torch.tensor([[0.0, 5.0, float("nan")], [1.0, 2.0, 3.0]])
    columns = Columns([Choice(temperature=1.0), Choice(temperature=1.0)], CPU)
    seen = torch.zeros((2, 3), dtype=torch.bool)
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    picked = pick(logits, columns, seen, generators)
    assert picked[0] == int(logits[0].nan_to_num(float("-inf")).argmax())
    assert picked[1] in (0, 1, 2)


def test_bytes_that_never_make_a_character_still_stream_within_four_tokens() -> None:
    from worker.weights.synthetic import SyntheticTokenizer

    tokenizer = SyntheticTokenizer(512, causal=True)
    lone = 5 + 0x9F  # a UTF-8 continuation byte with no lead: never a character
    text = Detokenizer(tokenizer, [])
    pieces = []
    for count in range(1, 13):
        text.update([lone] * count)
        pieces.append(text.delta())
    assert pieces[3] and not any(pieces[:3])  # held while a character might complete
    assert "".join(pieces) == tokenizer.decode([lone] * 12) == "\ufffd" * 12


def test_a_call_of_many_prompts_gets_its_share_of_rows_not_all_of_them_ahead_of_a_later_call(
    model: tuple[Any, Any],
) -> None:
    engine = _engine(model, rows=2)  # two rows at a time
    options = Options(max_new_tokens=4)
    for index in range(6):
        engine.add(Sequence_(("many", index), [2, 7, 8, 9], options))
    engine.step()  # the first two run
    admitted: list[Any] = [s.key for s in engine.rows]
    engine.add(Sequence_(("later", 0), [2, 7, 8, 9], options))  # another call, arriving now
    while engine.busy:
        engine.step()
        admitted += [s.key for s in engine.rows if s.key not in admitted]
    # the later call takes the next free row, as a separate call would (not after all six)
    assert admitted.index(("later", 0)) == 2, admitted
    assert [k for k in admitted if k[0] == "many"] == [("many", i) for i in range(6)]


def _admission_order(engine: Engine, first: list[Sequence_], late: list[Sequence_]) -> list[Any]:
    """Add `first` to `engine`, step it once, add `late`, then step it to the end: the keys
    of all of them in the order they were admitted (by step, then by their places in line)."""
    for sequence in first:
        engine.add(sequence)
    everything = [*first, *late]
    admitted: list[Any] = []

    def step() -> None:
        engine.step()
        new = [s for s in everything if s.admitted is not None and s.key not in admitted]
        admitted.extend(s.key for s in sorted(new, key=lambda s: s.tag))

    step()
    for sequence in late:
        engine.add(sequence)
    while engine.busy:
        step()
    return admitted


def _owned(key: Any, tenant: str | None, weight: float = 1.0, new: int = 4) -> Sequence_:
    sequence = Sequence_(key, [2, 7, 8, 9], Options(max_new_tokens=new))
    sequence.owner, sequence.weight = (None if tenant is None else ("tenant", tenant)), weight
    return sequence


def test_another_tenant_s_call_is_admitted_ahead_of_a_tenant_s_many_waiting_calls(
    model: tuple[Any, Any],
) -> None:
    # calls of one token: their rows end in the step that admits them, so each step finds
    # every row free (nothing to hand over) and admission alone decides who takes them
    for tenant in ("a", None):
        engine = _engine(model, rows=2)
        burst = [_owned((f"burst-{index}", 0), tenant, new=1) for index in range(6)]
        steady = _owned(("steady", 0), "b" if tenant else None, new=1)
        order = _admission_order(engine, burst, [steady])
        if tenant:  # one flow per tenant: the next free row
            assert order.index(("steady", 0)) == 2, order
        else:  # calls of no tenant take turns by call: one-prompt calls in the order they came
            assert order.index(("steady", 0)) == 6, order
    assert engine.line.empty


def test_a_tenant_s_later_call_gets_its_turn_among_the_tenant_s_calls(
    model: tuple[Any, Any],
) -> None:
    engine = _engine(model, rows=2)
    many = [_owned(("many", index), "a") for index in range(6)]  # one call of six prompts
    order = _admission_order(engine, many, [_owned(("later", 0), "a")])
    assert order.index(("later", 0)) == 2, order  # not after all six of the first call
    assert [k for k in order if k[0] == "many"] == [("many", i) for i in range(6)]


def test_a_tenant_s_calls_are_not_starved_by_calls_of_no_tenant_arriving_without_end(
    model: tuple[Any, Any],
) -> None:
    engine = _engine(model, rows=2)
    tenant = [_owned((f"a-{index}", 0), "a", new=1) for index in range(5)]
    for sequence in tenant:
        engine.add(sequence)
    for step in range(12):  # two more calls of no tenant every step: every row's worth
        for index in range(2):
            engine.add(_owned((f"plain-{step}-{index}", 0), None, new=1))
        engine.step()
    # calls of no tenant are one flow of weight 1 beside the tenant: they take turns
    assert all(s.admitted is not None for s in tenant)


def test_a_tenant_s_preempted_row_resumes_before_calls_that_came_after_it(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=256, max_rows=6, pace=Unpaced())
    many = [_owned(("many", index), "a", 3.0, new=20 + index) for index in range(6)]
    for sequence in many:  # one call holds every row; its rows end one a step
        engine.add(sequence)
    engine.step()
    engine.add(_owned(("other", 0), "b", new=40))
    engine.step()  # b is handed a row: a's youngest is preempted
    (preempted,) = [s for s in many if s in engine.waiting]
    late = [_owned(("later", 0), "a", 3.0, new=40), _owned(("more", 0), "b", new=40)]
    for sequence in late:
        engine.add(sequence)
    first: dict[str, int] = {}
    for step in range(60):
        engine.step()
        for sequence in (preempted, *late):
            if sequence in (*engine.prefilling, *engine.rows):
                first.setdefault(sequence.key[0], step)
    # its cost was counted when it was first admitted: it keeps its place in line
    assert first["many"] < min(first["later"], first["more"]), first
    engine.run()
    assert preempted.tokens == _alone(model, preempted.prompt, preempted.options)


def test_tenants_are_admitted_in_proportion_to_their_weights(model: tuple[Any, Any]) -> None:
    engine = _engine(model, rows=2)
    heavy = [_owned((f"heavy-{index}", 0), "heavy", 3.0) for index in range(12)]
    light = [_owned((f"light-{index}", 0), "light", 1.0) for index in range(12)]
    order = _admission_order(engine, heavy + light, [])
    first = [key[0].split("-")[0] for key in order[:8]]
    assert first.count("heavy") == 6 and first.count("light") == 2, order


def test_a_long_prompt_is_prefilled_in_chunks_while_every_running_row_decodes_each_step(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=256, pace=Fixed(16))
    running = Sequence_("running", [2, 9, 10, 11], Options(max_new_tokens=40))
    engine.add(running)
    engine.step()
    long_prompt = [2, *random.Random(3).choices(range(5, 512), k=99)]  # 100 tokens
    late = Sequence_("late", long_prompt, Options(max_new_tokens=8))
    engine.add(late)
    steps = 0
    while late.first_token is None:
        before = len(running.tokens)
        engine.step()
        steps += 1
        assert len(running.tokens) == before + 1  # no step froze the running stream
    assert steps == 7  # 100 tokens in chunks of 16
    engine.run()
    assert late.tokens == _alone(model, long_prompt, Options(max_new_tokens=8))
    assert running.tokens == _alone(model, [2, 9, 10, 11], Options(max_new_tokens=40))
    assert engine.kv is not None and engine.kv.pool.in_use == 0


def test_short_prompts_arriving_while_rows_decode_all_start_at_the_next_step(
    model: tuple[Any, Any],
) -> None:
    # each fits the step's pace of 16 tokens, though together they do not: no call waits
    # a step for the others' short prompts
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=256, pace=Fixed(16))
    engine.add(Sequence_("running", [2, 9, 10, 11], Options(max_new_tokens=20)))
    engine.step()
    arrivals = [
        Sequence_(i, [2, *range(30 + i, 39 + i)], Options(max_new_tokens=4)) for i in range(4)
    ]
    for sequence in arrivals:
        engine.add(sequence)
    engine.step()
    assert all(len(s.tokens) == 2 for s in arrivals)  # prefilled, then decoded with the rows
    assert not engine.waiting and not engine.prefilling


def test_a_lone_long_prompt_is_prefilled_at_once_when_nothing_decodes(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=256, pace=Fixed(16))
    alone = Sequence_("alone", [2, *range(20, 219)], Options(max_new_tokens=4))  # 200 tokens
    engine.add(alone)
    engine.step()
    assert len(alone.tokens) == 2  # its first token from the prefill, then a decode step


def test_a_call_cancelled_mid_prefill_gives_back_its_blocks_and_the_others_run_on(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=256, pace=Fixed(16))
    running = Sequence_("running", [2, 9, 10], Options(max_new_tokens=12))
    engine.add(running)
    engine.step()
    stopped = Sequence_(("gone", 0), [2, *range(30, 129)], Options(max_new_tokens=8))
    engine.add(stopped)
    engine.step()
    assert engine.prefilling == [stopped]
    engine.cancel(("gone", 0))
    ended = engine.step()
    assert stopped in ended and stopped.finish == "cancelled" and not stopped.tokens
    engine.run()
    assert running.finish == "length"
    assert engine.kv is not None and engine.kv.pool.in_use == 0


def test_prompts_that_begin_alike_while_one_is_prefilled_in_chunks_read_its_blocks(
    model: tuple[Any, Any],
) -> None:
    # the first of them is prefilled 16 tokens a step beside a running row: the others wait
    # for its blocks instead of computing the same ones, and get the tokens they get alone
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=256, pace=Fixed(16))
    engine.add(Sequence_("running", [2, 9, 10], Options(max_new_tokens=30)))
    engine.step()
    system = [2, *range(150, 213)]  # 64 tokens: four blocks
    calls = [Sequence_(i, [*system, 40 + i, 41], Options(max_new_tokens=6)) for i in range(3)]
    for sequence in calls:
        engine.add(sequence)
    engine.run()
    assert engine.kv is not None
    assert engine.kv.pool.reused_tokens == 2 * 64  # read by the two that waited
    for sequence in calls:
        assert sequence.tokens == _alone(model, sequence.prompt, Options(max_new_tokens=6))


def test_the_pace_allows_the_prompt_tokens_whose_compute_costs_one_decode_step() -> None:
    pace = Pace()
    assert pace.budget(2048) == 2048  # nothing measured yet: the engine's own bound
    for tokens in (64, 128, 256, 512):  # a pass costs 2 ms, and 10 us a token
        pace.prefilled(tokens, 0.002 + tokens * 1e-5)
    assert pace.budget(2048) == 2048  # no decode step measured yet
    for seconds in (0.004, 0.005, 0.006):
        pace.decoded(seconds)
    assert abs(pace.budget(2048) - 500) <= 1  # a whole prompt: 5 ms at 10 us a token
    assert pace.budget(300) == 300
    # a long prompt's chunk on a CPU: the pass's own 2 ms counted in, 3 ms of compute
    assert abs(pace.step(2048).chunk(5000, 0) - 300) <= 1
    assert abs(pace.step(2048, launch_bound=True).chunk(5000, 0) - 500) <= 1  # launches
    for _ in range(4):
        pace.decoded(1e-9)  # the median step now takes next to nothing
    assert pace.budget(2048) == LEAST_TOKENS


def test_the_pace_counts_the_columns_a_chunk_attends_so_a_late_chunk_is_smaller() -> None:
    pace = Pace()
    for tokens, past in ((64, 0), (64, 512), (128, 256), (256, 0), (128, 900), (32, 700)):
        width = past + tokens  # 1 ms a pass, 10 us a token, 10 ns a token's column
        pace.prefilled(tokens, 0.001 + tokens * 1e-5 + tokens * width * 1e-8, width)
    for _ in range(3):
        pace.decoded(0.005)
    costs = pace.costs()
    assert costs is not None
    assert [round(c, 10) for c in costs] == [0.001, 1e-5, 1e-8]
    early, late = pace.budget(2048), pace.budget(2048, past=900)
    step = pace.step(2048)
    assert abs(step.cost(early, 0) - 0.005) < 2e-5  # a whole prompt's 5 ms
    assert abs(step.cost(late, 900) - 0.005) < 2e-5
    assert late < early


def test_a_chunk_after_the_step_s_first_pays_for_a_pass_of_its_own() -> None:
    pace = Pace()
    for tokens in (64, 128, 256, 512):  # a pass costs 2 ms, and 10 us a token
        pace.prefilled(tokens, 0.002 + tokens * 1e-5)
    pace.decoded(0.006)
    step = pace.step(2048)  # 6 ms: the pass's 2 ms and 400 tokens
    assert abs(step.chunk(100, 0) - 100) <= 1
    step.spend(100, 0)  # 1 ms of compute: 3 ms left
    assert abs(step.chunk(1000, 0) - 100) <= 1  # less another pass's 2 ms
    step.spend(100, 0)
    assert step.spent and step.chunk(1000, 0) == 0


def test_on_a_gpu_chunks_of_several_prompts_share_a_step_without_paying_more_launches() -> None:
    pace = Pace()
    for tokens in (64, 128, 256, 512):  # a pass costs 2 ms, and 10 us a token
        pace.prefilled(tokens, 0.002 + tokens * 1e-5)
    pace.decoded(0.004)
    step = pace.step(2048, launch_bound=True)  # 4 ms of compute: 400 tokens
    for _ in range(4):  # chunks of one merged pass: no launch more for each
        assert abs(step.chunk(100, 0) - 100) <= 1
        step.spend(100, 0)
    assert step.chunk(100, 0) == 0


def test_a_step_whose_pass_alone_costs_more_than_a_decode_step_still_prefills_a_block() -> None:
    pace = Pace()
    for tokens in (64, 128, 256, 512):  # a pass costs 8 ms, and 10 us a token
        pace.prefilled(tokens, 0.008 + tokens * 1e-5)
    pace.decoded(0.004)
    step = pace.step(2048)  # on a CPU: nothing left once the pass's own 8 ms count
    assert step.spent
    assert step.chunk(1000, 0) == LEAST_TOKENS  # the step's first chunk: a block at least
    step.spend(LEAST_TOKENS, 0)
    assert step.chunk(1000, LEAST_TOKENS) == 0


def test_passes_of_one_size_give_a_pace_from_their_mean_cost_per_token() -> None:
    pace = Pace()
    pace.prefilled(100, 0.010)
    pace.prefilled(100, 0.012)
    pace.decoded(0.0055)
    assert pace.budget(2048) == 50  # 0.11 ms a token, fixed part included


def test_the_pace_of_a_few_rows_is_that_of_the_batch_the_waiting_calls_will_make() -> None:
    pace = Pace()
    pace.prefilled(100, 0.010)
    pace.prefilled(100, 0.010)
    pace.decoded(0.002)  # two rows decode in 2 ms
    assert pace.budget(2048, rows=2, building=2) == 20
    assert pace.budget(2048, rows=2, building=16) == 160  # as a step of 16 rows
