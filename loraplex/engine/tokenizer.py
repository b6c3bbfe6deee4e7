"""The checkpoint's tokenizer and chat template (transformers is only a loading aid here)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jinja2
from tokenizers import Tokenizer, decoders
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.prompts import check_text


class TokenizerWrapper:
    def __init__(self, model_dir: Path) -> None:
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        backend = getattr(self.hf, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise ValueError(f"{model_dir}: loraplex needs a fast tokenizer (tokenizer.json)")
        self.backend: Tokenizer = backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The Rust tokenizer directly: what transformers' encode does, minus its Python layers.
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """Raises InvalidRequestError for a model without a template or messages it refuses."""
        if not self.hf.chat_template:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt instead", param="messages"
            )
        _check_messages(messages)
        if not self.renders_tool_calls:
            messages = [_calls_as_content(m) for m in messages]
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except jinja2.TemplateError as error:  # templates raise to refuse, e.g. role order
            raise InvalidRequestError(
                f"the model's chat template refused the messages: {error}", param="messages"
            ) from None

    @functools.cached_property
    def renders_tool_calls(self) -> bool:
        """Whether the chat template shows an assistant message's tool calls (many don't, and
        drop them silently)."""
        probe = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("loraplex_probe_fn", {})]},
        ]
        try:
            text = self.hf.apply_chat_template(probe, tokenize=False)
        except (jinja2.TemplateError, TypeError, ValueError):
            return False
        return "loraplex_probe_fn" in text

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (a byte-level token may be part of a character).
        Any thread."""
        return self._token_bytes(token_id)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one wrapper per engine, kept for its life
    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.backend.id_to_token(token_id) if token_id >= 0 else None
        if piece is None:
            return b""
        if isinstance(self.backend.decoder, decoders.ByteLevel):
            return bytes(_BYTE_OF_CHAR.get(char, 0) for char in piece)
        byte = _BYTE_FALLBACK.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return self.backend.decode([token_id], skip_special_tokens=False).encode()

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        # The template already holds any BOS token; adding special tokens again would double it.
        text = self.apply_chat_template(messages, tools=tools)
        return self.encode(text, add_special_tokens=False)


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _calls_as_content(message: dict) -> dict:
    """For a template that does not show tool calls: the calls as the text a model writes when
    its output is constrained to call tools (a JSON list of {"name", "parameters"})."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = json.dumps(
        [{"name": c["function"]["name"], "parameters": c["function"]["arguments"]} for c in calls]
    )
    text = message.get("content") or ""
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": f"{text}\n{written}" if text else written}


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        ok = (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content", ""), str | type(None))
        )
        if not ok:
            raise InvalidRequestError(
                f"messages[{i}] must have a string role and string content", param="messages"
            )
        _check_tool_calls(message.get("tool_calls"), f"messages[{i}].tool_calls")
        check_text(message["role"] + (message.get("content") or ""), f"messages[{i}]")


def _check_tool_calls(calls: object, where: str) -> None:
    if calls is None:
        return
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list", param="messages")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        ok = (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), dict)
        )
        if not ok:
            raise InvalidRequestError(
                f"{where}[{j}] must be a function call with a name and an arguments object",
                param="messages",
            )
        check_text(function["name"], f"{where}[{j}].function.name")


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted
    past 255, so that every byte is one visible character."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    shown += range(ord("®"), ord("ÿ") + 1)
    hidden = [b for b in range(256) if b not in shown]
    mapping = {chr(b): b for b in shown}
    mapping.update({chr(256 + i): b for i, b in enumerate(hidden)})
    return mapping


_BYTE_OF_CHAR = _byte_level_map()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
