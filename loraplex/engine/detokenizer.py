"""Incremental detokenization with stop strings that never leak into streamed text.

Text arrives token by token; `tokenizers.decoders.DecodeStream` holds back the bytes of a
multi-byte UTF-8 character until it is complete. On top of that, the tail of the text that could
still grow into a stop string is held back until it either becomes one (the text is cut there) or
cannot any more (it is released).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Tokens of prompt context handed to the stream so that the first generated token decodes with
# the spacing it has in the middle of a text (sentencepiece drops a leading space otherwise).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(
            ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:], skip_special_tokens=skip_special_tokens
        )
        self._stop = stop
        self.text = ""
        self._num_emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def add_token(self, token_id: int) -> None:
        """Feed one generated token; sets `stopped` (and cuts `text`) when a stop string ends."""
        chunk = self._stream.step(self._tokenizer, token_id)
        if not chunk:
            return
        search_from = max(0, len(self.text) - max((len(s) for s in self._stop), default=0) + 1)
        self.text += chunk
        hits = [at for s in self._stop if (at := self.text.find(s, search_from)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take_new_text(self, final: bool) -> str:
        """Text not yet handed out, minus a tail that may still become a stop string."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        new = self.text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return new

    def _held_back(self) -> int:
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
