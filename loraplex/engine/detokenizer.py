"""Incremental detokenization with stop strings that never leak into streamed text.

Each step decodes a short window of tokens twice, with and without the new ones, and emits the
difference:

    ids:   ... prompt context | out out out | new
                ^prefix         ^read
    emitted text = decode(ids[prefix:]) minus decode(ids[prefix:read])

The context tokens give the first output token the spacing it has in the middle of a text
(sentencepiece drops a leading space otherwise). Text that ends in an unfinished UTF-8 character
(U+FFFD) is held back until the character completes, or the sequence ends.

A character whose first bytes are the prompt's last tokens is never the completion's: the context
stops before it, so the completion's own bytes of it decode (as U+FFFD) exactly as decoding the
completion's tokens alone would, and no prompt text is ever echoed.

On top of that, the tail of the text that could still grow into a stop string is held back until
it either becomes one (the text is cut there) or cannot any more (it is released).
"""

from __future__ import annotations

from tokenizers import Tokenizer

# Tokens of prompt context decoded with the output (see above).
_PROMPT_CONTEXT_TOKENS = 6
_UNFINISHED = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = self._whole_characters(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0  # decoding windows start here
        self._read = len(self._ids)  # the text of ids[prefix:read] is already accounted for
        self._stop = stop
        self.text = ""
        self._num_emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def add_token(self, token_id: int) -> None:
        """Feed one generated token; sets `stopped` (and cuts `text`) when a stop string ends."""
        self._ids.append(token_id)
        self._append(self._decode_new(final=False))

    def take_new_text(self, final: bool) -> str:
        """Text not yet handed out, minus a tail that may still become a stop string. `final`
        (the sequence ended) also releases an unfinished character as U+FFFD."""
        if final and not self.stopped:
            self._append(self._decode_new(final=True))
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        new = self.text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _whole_characters(self, context: list[int]) -> list[int]:
        """The context minus trailing tokens that end inside a character."""
        context = list(context)
        while context and self._decode(context).endswith(_UNFINISHED):
            context.pop()
        return context

    def _decode_new(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if after.endswith(_UNFINISHED) and not final:
            return ""  # wait for the rest of the character
        if len(after) <= len(before):
            # tokens that add no text (skipped special tokens): nothing to emit, keep the window
            self._read = len(self._ids)
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _append(self, chunk: str) -> None:
        if not chunk:
            return
        search_from = max(0, len(self.text) - max((len(s) for s in self._stop), default=0) + 1)
        self.text += chunk
        hits = [at for s in self._stop if (at := self.text.find(s, search_from)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
