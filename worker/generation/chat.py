"""Turn a prompt or a chat into the token ids a model continues.

A chat is rendered by a Jinja chat template: the catalog's `chat_template` for the model when
it has one, else the tokenizer's own. A Hugging Face tokenizer renders it itself
(`apply_chat_template`, with its helpers and special tokens); gpufleet's synthetic tokenizer
has no renderer, so the template runs here in Jinja's sandbox, as transformers runs it, with
`messages`, `add_generation_prompt`, `bos_token` and `eos_token`. A model with no template
refuses chats with a `PayloadError` that says what to do.
"""

from __future__ import annotations

import functools
from typing import Any

from placement.errors import PayloadError
from worker.generation.params import Chat, Prompt


def prompt_ids(tokenizer: Any, prompt: Prompt, template: str | None) -> list[int]:
    """The ids of a prompt (with the tokenizer's special tokens) or of a rendered chat."""
    if isinstance(prompt, str):
        return [int(i) for i in tokenizer.encode(prompt)]
    text = render(tokenizer, prompt, template)
    # The template writes the special tokens it wants (a BOS, role markers) itself.
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def render(tokenizer: Any, chat: Chat, template: str | None) -> str:
    """The chat as text, ready for the model to write the assistant's turn."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise PayloadError(
            "this model has no chat template, so it cannot take messages; send the prompt"
            " as a string, or give the model a chat_template in the catalog"
        )
    try:
        if hasattr(tokenizer, "apply_chat_template"):
            text = tokenizer.apply_chat_template(
                chat.as_dicts(), chat_template=template, add_generation_prompt=True,
                tokenize=False,
            )  # fmt: skip
        else:
            text = _compiled(template).render(
                messages=chat.as_dicts(),
                add_generation_prompt=True,
                bos_token=getattr(tokenizer, "bos_token", "") or "",
                eos_token=getattr(tokenizer, "eos_token", "") or "",
            )
    except PayloadError:
        raise
    except Exception as exc:  # the template's own raise_exception, or a template error
        raise PayloadError(f"the model's chat template refused these messages: {exc}") from None
    if not isinstance(text, str):
        raise PayloadError("the model's chat template did not render to text")
    return text


@functools.lru_cache(maxsize=32)
def _compiled(template: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
