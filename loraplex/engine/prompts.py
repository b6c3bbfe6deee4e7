"""Prompts as clients send them, checked strictly: a string, or a list of token ids."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from loraplex.engine.tokenizer import TokenizerWrapper


def prompt_token_ids(
    prompt: object, tokenizer: TokenizerWrapper, vocab_size: int
) -> tuple[str | None, list[int]]:
    """-> (the prompt's text if it had one, its token ids). Raises InvalidRequestError."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty", param="prompt")
        check_text(prompt, "prompt")
        return prompt, tokenizer.encode(prompt)
    if not isinstance(prompt, list | tuple):
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
            param="prompt",
        )
    if not prompt:
        raise InvalidRequestError("prompt is empty", param="prompt")
    for token in prompt:
        # bool is an int in Python, and no client means True as token 1
        if not isinstance(token, int) or isinstance(token, bool):
            raise InvalidRequestError(
                f"prompt token ids must be integers, got {token!r}", param="prompt"
            )
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {vocab_size}), got {token}", param="prompt"
            )
    return None, list(prompt)


def check_text(text: str, param: str) -> None:
    """Text must be encodable as UTF-8 (JSON lets a lone surrogate such as "\\ud800" through)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"{param} is not valid Unicode text: {error.reason} at position {error.start}",
            param=param,
        ) from None
