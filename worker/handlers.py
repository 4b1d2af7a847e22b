"""Run one request on a loaded model: validate the payload, run the task, return plain JSON.

Every catalog model serves one task. `run` checks the caller's ``inputs`` and ``params``
before the model sees them, so a malformed request fails with a `PayloadError` that says
what was wrong and what to send instead, and never with an obscure tensor error from deep
inside transformers. Payloads arrive through Celery's JSON serializer, so anything that is
not a plain JSON type (bytes from a pickle attempt, arbitrary objects) is refused outright.

A failure inside the model itself (a RuntimeError, a CUDA error) propagates unchanged: the
worker decides whether to retry, re-route or restart.

Every result holds plain lists, ints, floats and strs, plus ``"batch": n``; a single string
is served as a batch of one, so the shapes never depend on how the caller sent it:

============================  ===================================================
task                          result
============================  ===================================================
feature-extraction            ``{"embeddings": [[float]*dim]*n, "dim": dim,``
                              ``"tokens": int}`` (the tokens read, for usage)
text-generation               ``{"texts": [str]*n, "tokens": [[int]]*n,``
                              ``"prompt_tokens": [int]*n, "finish_reasons": [str]*n}``
text-classification           ``{"labels": [[{"label": str, "score": float}]]*n}``
fill-mask                     ``{"predictions": [[{"token", "token_id", "score"}]]*n}``
forward                       ``{"shape": [int], "mean": float, "std": float, "head": [float]}``
============================  ===================================================

Torch and transformers are imported lazily, so `validate` can check a payload on the
caller's side without importing either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from placement.catalog.catalog import TASKS
from placement.errors import CatalogError, PayloadError
from worker import payloads
from worker.generation import params as generation_params
from worker.passes import max_positions
from worker.payloads import MAX_BATCH, MAX_CHARS, Param, validate_inputs

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAX_TOKENS = 512  # the max_length ceiling (max_new_tokens: worker.generation.params)
MAX_TOP_K = 50
# Tokenizers without a real limit report a huge model_max_length (int(1e30)).
_NO_LIMIT = 1_000_000


def auto_class(task: str) -> type:
    """The transformers auto class that builds or loads a model for `task`."""
    import transformers

    names = {
        "feature-extraction": "AutoModel",
        "text-generation": "AutoModelForCausalLM",
        "text-classification": "AutoModelForSequenceClassification",
        "fill-mask": "AutoModelForMaskedLM",
        "forward": "AutoModel",
    }
    if task not in names:
        raise CatalogError(f"task {task!r} is not one of {', '.join(TASKS)}")
    cls: type = getattr(transformers, names[task])
    return cls


# ---------------------------------------------------------------------------------------
# Validation


_MAX_LENGTH = Param(int, 256, 1, MAX_TOKENS)
#: Each task's params: what `check(name, value)` accepts, and the `default`.
PARAMS: dict[str, Mapping[str, Any]] = {
    "feature-extraction": {"normalize": Param(bool, True), "max_length": _MAX_LENGTH},
    "text-generation": generation_params.PARAMS,
    # top_k null (the default) returns every label, best first.
    "text-classification": {
        "top_k": Param(int, None, 1, MAX_TOP_K, nullable=True),
        "max_length": _MAX_LENGTH,
    },
    "fill-mask": {"top_k": Param(int, 5, 1, MAX_TOP_K), "max_length": _MAX_LENGTH},
    "forward": {"max_length": _MAX_LENGTH},
}


def validate_params(task: str, params: object) -> dict[str, Any]:
    """The request's params for `task`, checked, with every default filled in."""
    if task not in PARAMS:
        raise CatalogError(f"task {task!r} is not one of {', '.join(TASKS)}")
    return payloads.check_params(task, params, PARAMS[task])


def validate(task: str, inputs: object, params: object) -> tuple[list[Any], dict[str, Any]]:
    """Check a request without running it: the texts and the full params, or PayloadError.

    The texts are strings, except a text-generation chat: one `Chat` (a list of role and
    content messages, `worker.generation.params`). Needs neither torch nor a model, so a
    caller or router can refuse a bad request before it costs a GPU hop. Model-specific
    checks (the mask token, the context window) wait for `run`.
    """
    if task == "text-generation":
        return generation_params.validate(inputs, params)
    options = validate_params(task, params)
    return validate_inputs(inputs), options


# ---------------------------------------------------------------------------------------
# Running


def run(  # noqa: PLR0917 - the positional signature is what the worker calls
    task: str,
    model: torch.nn.Module,
    tokenizer: Any,
    inputs: object,
    params: object | None,
    device: torch.device | None,
) -> dict[str, Any]:
    """Validate a request, run it under ``torch.inference_mode()`` and return plain JSON.

    `device` is where the input tensors go; None means the device of the model's first
    parameter, which is also where accelerate expects inputs of a model split over GPUs.
    Raises PayloadError for a bad request; errors from the model itself propagate.
    """
    texts, options = validate(task, inputs, params)
    check_texts(task, tokenizer, texts)
    return run_many(task, model, tokenizer, [texts], options, device)[0]


def check_texts(task: str, tokenizer: Any, texts: list[str]) -> None:
    """The checks that need the model's tokenizer, made per call so that a batch never
    fails for one caller's text: a fill-mask input holds exactly one mask token."""
    if task != "fill-mask":
        return
    mask_token = tokenizer.mask_token
    if mask_token is None or tokenizer.mask_token_id is None:
        raise PayloadError("this model's tokenizer has no mask token, so it cannot fill masks")
    for i, text in enumerate(texts):
        where = "inputs" if len(texts) == 1 else f"inputs[{i}]"
        count = text.count(mask_token)
        if count != 1:
            found = "no" if count == 0 else str(count)
            raise PayloadError(
                f"{where} has {found} mask token {mask_token!r}; put exactly one {mask_token!r}"
                f" where the missing word goes, e.g. 'Paris is the {mask_token} of France.'"
            )


def run_many(  # noqa: PLR0917 - as `run`
    task: str,
    model: torch.nn.Module,
    tokenizer: Any,
    calls: Sequence[list[str]],
    options: dict[str, Any],
    device: torch.device | None,
) -> list[dict[str, Any]]:
    """Run several calls' validated texts, all with the same `options`, in one forward pass;
    each call's result is what `run` returns for it alone (to float rounding).

    text-generation runs the calls as one continuous batch (`worker.generation`): each
    call's greedy tokens are those it gets alone.
    """
    import torch

    target = device if device is not None else _model_device(model)
    net: Any = model
    with torch.inference_mode():
        if task == "text-generation":
            results = _text_generation(net, tokenizer, calls, options, target)
        else:
            texts = [text for call in calls for text in call]
            sizes = [len(call) for call in calls]
            results = _HANDLERS[task](net, tokenizer, texts, options, target, sizes)
    for result, call in zip(results, calls, strict=True):
        result["batch"] = len(call)
    log.debug("ran %s on %d calls in one pass", task, len(calls))
    return results


def _model_device(model: torch.nn.Module) -> torch.device:
    import torch

    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


def _encode(
    model: Any, tokenizer: Any, texts: list[str], max_length: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Tokenize a batch for an encoder: right-padded, truncated to what the model can take."""
    limit = max_length
    model_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_limit, int) and 0 < model_limit < _NO_LIMIT:
        limit = min(limit, model_limit)
    positions = max_positions(getattr(model, "config", None))
    if positions is not None:
        limit = min(limit, positions)
    encoding = tokenizer(
        texts,
        padding=True,
        truncation=True,
        max_length=limit,
        return_tensors="pt",
        padding_side="right",  # `_forward` cuts each call's rows at its own length
    )
    if encoding["input_ids"].shape[-1] == 0:
        raise PayloadError("inputs encode to no tokens at all; send some text")
    return {key: value.to(device) for key, value in encoding.items()}


def _main_output(output: Any) -> torch.Tensor:
    """The tensor a model call is about: last_hidden_state, else logits, else the first."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    for name in ("last_hidden_state", "logits"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    first = output[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"the model returned {type(output).__name__} without a tensor")
    return first


def _rows(values: list[Any], sizes: Sequence[int]) -> Iterator[list[Any]]:
    """`values` cut into consecutive runs of `sizes`: one run per call."""
    start = 0
    for size in sizes:
        yield values[start : start + size]
        start += size


def _feature_extraction(  # noqa: PLR0917
    model: Any,
    tokenizer: Any,
    texts: list[str],
    options: dict[str, Any],
    device: torch.device,
    sizes: Sequence[int],
) -> list[dict[str, Any]]:
    """Mean pooling over the attention mask, then L2 normalisation (sentence-transformers)."""
    import torch

    encoding = _encode(model, tokenizer, texts, options["max_length"], device)
    hidden = _main_output(model(**encoding)).float()
    mask = encoding["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    if options["normalize"]:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
    dim = int(pooled.shape[-1])
    lengths = encoding["attention_mask"].sum(dim=1).tolist()
    rows = zip(_rows(pooled.cpu().tolist(), sizes), _rows(lengths, sizes), strict=True)
    return [{"embeddings": v, "dim": dim, "tokens": int(sum(n))} for v, n in rows]


def _text_generation(
    model: Any,
    tokenizer: Any,
    calls: Sequence[list[Any]],
    options: dict[str, Any],
    device: torch.device,
) -> list[dict[str, Any]]:
    """The calls on one engine with an unbounded budget (a caller without a ledger); the
    fleet's workers run theirs with the model's budget (`worker.residency`)."""
    from worker.generation.engine import Engine, eos_ids
    from worker.generation.serving import GenCall, run_calls

    window = max_positions(getattr(model, "config", None))
    # no CUDA graphs: recorded for one engine's calls, they would go with it
    engine = Engine(
        model, tokenizer, device, budget=2**62, window=window, eos=eos_ids(model, tokenizer),
        graphs=False,
    )  # fmt: skip
    gen_calls = [
        GenCall(str(i), call[0].as_dicts() if _is_chat(call) else list(call), options)
        for i, call in enumerate(calls)
    ]
    results = []
    for outcome in run_calls(engine, gen_calls, None):
        if isinstance(outcome, BaseException):
            raise outcome
        outputs = dict(outcome.outputs)
        outputs.pop("batch", None)
        results.append(outputs)
    return results


def _is_chat(call: list[Any]) -> bool:
    return len(call) == 1 and isinstance(call[0], generation_params.Chat)


def _text_classification(  # noqa: PLR0917
    model: Any,
    tokenizer: Any,
    texts: list[str],
    options: dict[str, Any],
    device: torch.device,
    sizes: Sequence[int],
) -> list[dict[str, Any]]:
    """Softmax over the logits (sigmoid for multi-label models), labels from id2label."""
    import torch

    encoding = _encode(model, tokenizer, texts, options["max_length"], device)
    logits = _main_output(model(**encoding)).float()
    config = model.config
    if getattr(config, "problem_type", None) == "multi_label_classification":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    count = scores.shape[-1]
    top_k = count if options["top_k"] is None else min(options["top_k"], count)
    id2label = getattr(config, "id2label", None) or {}
    values, indices = torch.sort(scores.cpu(), dim=-1, descending=True, stable=True)
    labels = [
        [
            {"label": str(id2label.get(i, f"LABEL_{i}")), "score": score}
            for score, i in zip(row_values[:top_k], row_indices[:top_k], strict=True)
        ]
        for row_values, row_indices in zip(values.tolist(), indices.tolist(), strict=True)
    ]
    return [{"labels": rows} for rows in _rows(labels, sizes)]


def _fill_mask(  # noqa: PLR0917
    model: Any,
    tokenizer: Any,
    texts: list[str],
    options: dict[str, Any],
    device: torch.device,
    sizes: Sequence[int],
) -> list[dict[str, Any]]:
    """The top_k tokens for the one mask token of each input (`check_texts`), best first."""
    import torch

    mask_token, mask_id = tokenizer.mask_token, tokenizer.mask_token_id
    encoding = _encode(model, tokenizer, texts, options["max_length"], device)
    input_ids = encoding["input_ids"]
    rows, positions = (input_ids == mask_id).nonzero(as_tuple=True)
    if rows.tolist() != list(range(len(texts))):
        width = input_ids.shape[-1]
        raise PayloadError(
            f"truncation to {width} tokens cut the mask token {mask_token!r} off an input;"
            " move the mask earlier or raise max_length"
        )
    logits = _main_output(model(**encoding))[rows, positions].float()
    probs = torch.softmax(logits, dim=-1)
    top_k = min(options["top_k"], probs.shape[-1])
    values, indices = torch.topk(probs, top_k, dim=-1)
    predictions = [
        [
            {"token": tokenizer.decode([token_id]).strip(), "token_id": token_id, "score": score}
            for score, token_id in zip(row_values, row_indices, strict=True)
        ]
        for row_values, row_indices in zip(
            values.cpu().tolist(), indices.cpu().tolist(), strict=True
        )
    ]
    return [{"predictions": rows} for rows in _rows(predictions, sizes)]


def _forward(  # noqa: PLR0917
    model: Any,
    tokenizer: Any,
    texts: list[str],
    options: dict[str, Any],
    device: torch.device,
    sizes: Sequence[int],
) -> list[dict[str, Any]]:
    """A plain forward pass, summarised per call: shape, mean, std and the first values of
    its row one.

    The statistics cover every position of the call's own rows up to its own longest input,
    padding included, so they do not depend on what else shared the pass: the summary
    exists to prove a model ran and to compare runs, not to be a representation.
    """
    encoding = _encode(model, tokenizer, texts, options["max_length"], device)
    output = _main_output(model(**encoding)).float()
    if len(sizes) > 1 and (output.dim() < 2 or output.shape[0] != len(texts)):
        raise ValueError(f"cannot split an output of shape {list(output.shape)} by call")
    shared = len(sizes) > 1
    lengths = encoding["attention_mask"].sum(dim=1).tolist() if shared else []
    width = encoding["input_ids"].shape[-1]
    results = []
    start = 0
    for size in sizes:
        mine = output[start : start + size] if shared else output
        if shared and mine.dim() >= 3 and mine.shape[1] == width:
            mine = mine[:, : int(max(lengths[start : start + size]))]
        start += size
        flat = mine.reshape(-1)
        first_row = mine.reshape(-1, mine.shape[-1])[0] if mine.dim() > 1 else flat
        results.append(
            {
                "shape": list(mine.shape),
                "mean": float(flat.mean()),
                "std": float(flat.std(unbiased=False)),
                "head": first_row[:8].cpu().tolist(),
            }
        )
    return results


_Handler = Callable[
    [Any, Any, list[str], dict[str, Any], "torch.device", Sequence[int]], list[dict[str, Any]]
]
_HANDLERS: dict[str, _Handler] = {
    "feature-extraction": _feature_extraction,
    "text-classification": _text_classification,
    "fill-mask": _fill_mask,
    "forward": _forward,
}

__all__ = [
    "MAX_BATCH",
    "MAX_CHARS",
    "MAX_TOKENS",
    "MAX_TOP_K",
    "PARAMS",
    "Param",
    "auto_class",
    "check_texts",
    "run",
    "run_many",
    "validate",
    "validate_inputs",
    "validate_params",
]
