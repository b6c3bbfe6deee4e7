"""What a server needs of a model short of its weights: the tokenizer and the vocabulary, to
template conversations, tokenize and check prompts, and spell logprob tokens. An `AsyncEngine`
has one; a server in front of remote engine replicas (Ray Serve) builds its own from the
checkpoint directory, without loading the weights."""

from __future__ import annotations

from loraplex.engine.config import ModelConfig
from loraplex.engine.default_model import resolve_model
from loraplex.engine.prompts import check_text, prompt_token_ids
from loraplex.engine.tokenizer import TokenizerWrapper


class Front:
    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @classmethod
    def load(cls, model: str) -> Front:
        """From a checkpoint directory (or "default"): reads the config and the tokenizer."""
        model_dir = resolve_model(model)
        return cls(TokenizerWrapper(model_dir), ModelConfig.from_dir(model_dir).vocab_size)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation (and the tools, where the template renders them) through the model's
        chat template, as token ids. Any thread."""
        return self.tokenizer.encode_chat(messages, tools)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (for logprobs). Any thread."""
        return self.tokenizer.token_bytes(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt, as the engine would tokenize it. Any thread. Raises
        InvalidRequestError for text that is not valid Unicode."""
        check_text(text, "prompt")
        return self.tokenizer.encode(text)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt (text, or token ids) checked as the engine checks it -> its token ids. Any
        thread. Raises InvalidRequestError (empty, not Unicode, ids outside the vocabulary)."""
        return prompt_token_ids(prompt, self.tokenizer, self.vocab_size)[1]


class FrontMethods:
    """The tokenizer side of an engine's surface, from its `front` (AsyncEngine and the
    platform's RemoteEngine alike)."""

    front: Front

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.front.encode_chat(messages, tools)

    def token_bytes(self, token_id: int) -> bytes:
        return self.front.token_bytes(token_id)

    def encode(self, text: str) -> list[int]:
        return self.front.encode(text)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return self.front.prompt_ids(prompt)
