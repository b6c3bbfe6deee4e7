"""The checkpoint's tokenizer and chat template (transformers is only a loading aid here)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase


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
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template already holds any BOS token; adding special tokens again would double it.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
