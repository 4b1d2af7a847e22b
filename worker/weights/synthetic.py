"""Synthetic transformer models, built from a catalog `config` at run time.

A catalog entry with ``source: synthetic`` names no weights on disk: the worker builds the
model from its ``config`` (a transformers config mapping with a ``model_type``) with
randomly initialised weights, so the whole fleet, handlers included, runs on a laptop
without downloading anything. Two guarantees make such models useful in tests and demos:

- **Deterministic**: the weights come from a seed derived from the model name, so the same
  name and config give bit-identical outputs in every process, on every run.
- **Harmless**: the global torch RNG is forked around the build, so building a model never
  changes what ``torch.rand`` returns elsewhere in the process.

`SyntheticTokenizer` is the matching tokenizer: UTF-8 bytes folded into the model's
vocabulary after five reserved special ids. It implements the part of the Hugging Face
tokenizer API that `worker.handlers` uses, and nothing more.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any, overload

import torch

from placement.catalog.catalog import ModelSpec
from placement.catalog.kvcache import DEFAULT_CONFIGS
from placement.errors import CatalogError
from worker.passes import max_positions

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def seed_for(name: str) -> int:
    """The weight seed of model `name`: the first 63 bits of its SHA-256.

    A hash, not Python's ``hash()``, which is salted per process.
    """
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") >> 1


def build_synthetic(spec: ModelSpec) -> tuple[torch.nn.Module, SyntheticTokenizer]:
    """Build the synthetic model of `spec` and its tokenizer: eval mode, on CPU.

    The config is ``spec.config`` (else `DEFAULT_CONFIGS` for the task) passed to
    ``AutoConfig.for_model``; the model class is `worker.handlers.auto_class(spec.task)`.
    The config's pad/bos/eos ids are replaced by the tokenizer's, so generation stops and
    pads on ids the tokenizer knows. dtype "auto" means the config's own ``dtype`` (or
    ``torch_dtype``) when it names one, else float32. Weights are drawn in float32 under a
    forked, seeded RNG, then cast, so the same name and config give the same bits at a
    given dtype. Raises CatalogError when transformers cannot build the config.
    """
    from transformers import AutoConfig

    from worker.handlers import auto_class

    fields = dict(spec.config) if spec.config is not None else dict(DEFAULT_CONFIGS[spec.task])
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise CatalogError(f"model {spec.name!r}: field 'config': add a model_type, e.g. 'bert'")
    declared = fields.pop("dtype", None), fields.pop("torch_dtype", None)
    declared_dtype = declared[0] if declared[0] is not None else declared[1]
    # The tokenizer's special ids win over the config's (gpt2 defaults to 50256, outside a
    # small vocab), so generation pads and stops on ids the tokenizer knows.
    fields.update(
        pad_token_id=SyntheticTokenizer.pad_token_id,
        bos_token_id=SyntheticTokenizer.bos_token_id,
        eos_token_id=SyntheticTokenizer.eos_token_id,
    )
    try:
        config: Any = AutoConfig.for_model(model_type, **fields)
    except Exception as exc:
        raise CatalogError(
            f"model {spec.name!r}: field 'config': transformers cannot build it: {exc}"
        ) from exc

    vocab_size = getattr(config, "vocab_size", None)
    if not isinstance(vocab_size, int) or vocab_size <= SyntheticTokenizer.N_SPECIAL:
        raise CatalogError(
            f"model {spec.name!r}: field 'config': vocab_size must be a whole number above"
            f" {SyntheticTokenizer.N_SPECIAL} for the synthetic tokenizer, got {vocab_size!r}"
        )
    tokenizer = SyntheticTokenizer(
        vocab_size,
        causal=spec.task == "text-generation",
        model_max_length=max_positions(config) or 512,
    )

    dtype = _resolve_dtype(spec, declared_dtype)
    seed = seed_for(spec.name)
    # transformers draws initial weights from the global CPU generator. fork_rng restores
    # it afterwards, and seeding only that generator (not torch.manual_seed, which also
    # reseeds every CUDA device) leaves the GPU RNGs alone. The generator is global for the
    # duration, so do not build from two threads at once. torch.device("cpu") overrides
    # any default device a caller may have set.
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(seed)
        try:
            model_class: Any = auto_class(spec.task)
            model: Any = model_class.from_config(config)
        except Exception as exc:
            raise CatalogError(
                f"model {spec.name!r}: transformers cannot build a {spec.task} model from"
                f" this config: {exc}"
            ) from exc
    model = model.to(dtype=dtype).eval()
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.pad_token_id = tokenizer.pad_token_id
        generation_config.bos_token_id = tokenizer.bos_token_id
        generation_config.eos_token_id = tokenizer.eos_token_id
    log.debug(
        "built synthetic %s (%s, %s, %s) from seed %d",
        spec.name,
        model_type,
        spec.task,
        dtype,
        seed,
    )
    result: torch.nn.Module = model
    return result, tokenizer


def _resolve_dtype(spec: ModelSpec, declared: object) -> torch.dtype:
    """The spec's dtype; "auto" means the config's declared dtype, else float32."""
    name = spec.dtype
    if name == "auto":
        name = str(declared).removeprefix("torch.") if declared is not None else "float32"
    if name not in _DTYPES:
        raise CatalogError(
            f"model {spec.name!r}: dtype {name!r} is not supported; use one of {', '.join(_DTYPES)}"
        )
    return _DTYPES[name]


class SyntheticTokenizer:
    """A deterministic byte tokenizer for synthetic models.

    Ids 0-4 are [PAD], [UNK], [CLS], [SEP] and [MASK]; every other id stands for the byte
    ``(id - 5) % 256``, and byte ``b`` encodes as ``5 + b % (vocab_size - 5)``. The special
    token strings are recognised inside text, as a Hugging Face tokenizer does. An encoder
    tokenizer wraps text in [CLS] ... [SEP]; a causal one (``causal=True``) only prepends
    [CLS] as the BOS token. [SEP] is the EOS token.
    """

    N_SPECIAL = 5
    pad_token, unk_token, cls_token, sep_token, mask_token = (
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
    )
    pad_token_id, unk_token_id, cls_token_id, sep_token_id, mask_token_id = range(5)
    bos_token, eos_token = cls_token, sep_token
    bos_token_id, eos_token_id = cls_token_id, sep_token_id
    model_input_names = ("input_ids", "attention_mask")
    _SPECIALS = (pad_token, unk_token, cls_token, sep_token, mask_token)
    _SPLIT = re.compile("(" + "|".join(map(re.escape, _SPECIALS)) + ")")

    def __init__(
        self, vocab_size: int, *, causal: bool = False, model_max_length: int = 512
    ) -> None:
        if vocab_size <= self.N_SPECIAL:
            raise ValueError(f"vocab_size must be above {self.N_SPECIAL}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.causal = causal
        self.model_max_length = model_max_length
        self.padding_side = "left" if causal else "right"
        self.truncation_side = "right"

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"SyntheticTokenizer(vocab_size={self.vocab_size}, causal={self.causal})"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one text, with [CLS]/[SEP] (encoder) or [CLS] (causal) if asked."""
        ids: list[int] = []
        span = self.vocab_size - self.N_SPECIAL
        for piece in self._SPLIT.split(text):
            if piece in self._SPECIALS:
                ids.append(self._SPECIALS.index(piece))
            elif piece:
                ids.extend(self.N_SPECIAL + b % span for b in piece.encode("utf-8"))
        if not add_special_tokens:
            return ids
        return (
            [self.cls_token_id, *ids]
            if self.causal
            else [self.cls_token_id, *ids, self.sep_token_id]
        )

    def __call__(
        self,
        texts: str | Sequence[str],
        *,
        padding: bool | str = True,
        truncation: bool | str = True,
        max_length: int | None = None,
        return_tensors: str | None = "pt",
        padding_side: str | None = None,
        add_special_tokens: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Encode a text or a batch into ``input_ids`` and ``attention_mask`` tensors.

        Truncation keeps the first ``max_length`` ids (default ``model_max_length``), with
        the closing [SEP] kept for an encoder. Without padding the batch must share a length.
        """
        if return_tensors not in ("pt", None):
            raise ValueError(f"return_tensors={return_tensors!r}: only 'pt' is supported")
        batch = [texts] if isinstance(texts, str) else list(texts)
        limit = max_length if max_length is not None else self.model_max_length
        rows = [self.encode(text, add_special_tokens) for text in batch]
        if truncation:
            rows = [self._truncate(row, limit, add_special_tokens) for row in rows]
        width = max((len(row) for row in rows), default=0)
        if not padding and any(len(row) != width for row in rows):
            raise ValueError("texts differ in length; pass padding=True")
        left = (padding_side or self.padding_side) == "left"
        ids, mask = [], []
        for row in rows:
            fill = width - len(row)
            ids.append(
                [self.pad_token_id] * fill + row if left else row + [self.pad_token_id] * fill
            )
            mask.append([0] * fill + [1] * len(row) if left else [1] * len(row) + [0] * fill)
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long).reshape(len(rows), width),
            "attention_mask": torch.tensor(mask, dtype=torch.long).reshape(len(rows), width),
        }

    def _truncate(self, row: list[int], limit: int, specials: bool) -> list[int]:
        if len(row) <= limit:
            return row
        if specials and not self.causal and limit >= 2:
            return [*row[: limit - 1], self.sep_token_id]
        return row[:limit]

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str: ...
    @overload
    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]: ...

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        """Token strings: a special's name, a printable ASCII byte, else ``<0xAB>``."""
        if isinstance(ids, int):
            return self._token(ids)
        return [self._token(int(i)) for i in ids]

    def _token(self, token_id: int) -> str:
        if 0 <= token_id < self.N_SPECIAL:
            return self._SPECIALS[token_id]
        byte = self._byte(token_id)
        return chr(byte) if 0x21 <= byte <= 0x7E else f"<0x{byte:02X}>"

    def _byte(self, token_id: int) -> int:
        return (token_id - self.N_SPECIAL) % 256

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
        """Text of `ids`: bytes decoded as UTF-8 (invalid sequences become U+FFFD)."""
        out: list[str] = []
        buffer = bytearray()
        for token_id in (int(i) for i in ids):
            if 0 <= token_id < self.N_SPECIAL:
                out.append(buffer.decode("utf-8", errors="replace"))
                buffer.clear()
                if not skip_special_tokens:
                    out.append(self._SPECIALS[token_id])
            else:
                buffer.append(self._byte(token_id))
        out.append(buffer.decode("utf-8", errors="replace"))
        return "".join(out)

    def batch_decode(
        self, sequences: Iterable[Iterable[int]] | torch.Tensor, skip_special_tokens: bool = False
    ) -> list[str]:
        """`decode` of each sequence."""
        return [self.decode(seq, skip_special_tokens=skip_special_tokens) for seq in sequences]


__all__ = ["DEFAULT_CONFIGS", "SyntheticTokenizer", "build_synthetic", "seed_for"]
