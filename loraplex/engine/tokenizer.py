"""The checkpoint's tokenizer and chat template (transformers is only a loading aid here)."""

from __future__ import annotations

from pathlib import Path

import jinja2
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from loraplex.engine.errors import InvalidRequestError


class TokenizerWrapper:
    def __init__(self, model_dir: Path) -> None:
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        backend = getattr(self.hf, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise ValueError(f"{model_dir}: loraplex needs a fast tokenizer (tokenizer.json)")
        self.backend: Tokenizer = backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Raises InvalidRequestError for a model without a template or messages it refuses."""
        if not self.hf.chat_template:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt instead", param="messages"
            )
        _check_messages(messages)
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except jinja2.TemplateError as error:  # templates raise to refuse, e.g. role order
            raise InvalidRequestError(
                f"the model's chat template refused the messages: {error}", param="messages"
            ) from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template already holds any BOS token; adding special tokens again would double it.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


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
