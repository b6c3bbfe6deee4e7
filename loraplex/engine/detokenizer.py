"""Incremental detokenization with stop strings that never leak into streamed text.

Each step decodes a short window of tokens twice, with and without the new ones, and emits the
difference:

    ids:   ... prompt context | out out out | new
                ^prefix         ^read
    emitted text = decode(ids[prefix:]) minus decode(ids[prefix:read])

The context tokens give the first output token the spacing it has in the middle of a text
(sentencepiece drops a leading space otherwise). Text that ends in an unfinished UTF-8 character
(U+FFFD) is held back until the character completes (at most 4 bytes), or the sequence ends. The
window never grows past a few tokens, so each step costs the same however long the output.

A character whose first bytes are the prompt's last tokens is never the completion's: the context
stops before it, so the completion's own bytes of it decode (as U+FFFD) exactly as decoding the
completion's tokens alone would, and no prompt text is ever echoed.

Stop strings are matched with one Knuth-Morris-Pratt automaton each, fed character by character:
a full match cuts the text there; a partial one (a tail that may still become a stop string) is
held back until it either completes or breaks. Linear in the text, whatever the stop strings.
"""

from __future__ import annotations

from tokenizers import Tokenizer

# Tokens of prompt context decoded with the output (see above); also the window kept when
# tokens add no text.
_CONTEXT_TOKENS = 6
_MAX_CHARACTER_BYTES = 4  # a UTF-8 character spans at most this many byte tokens
_UNFINISHED = "\ufffd"


class StopMatcher:
    """Where a stop string ends in a growing text, and how much of its tail may still become
    one."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._failure = [_failure_function(s) for s in stops]
        self._state = [0] * len(stops)  # characters of each stop matched at the text's end

    def feed(self, text: str) -> tuple[int, int] | None:
        """Advance over `text`. -> (index in `text` just past the first stop string completed,
        that stop string's length), or None. Of several completed at once, the longest."""
        for i, char in enumerate(text):
            completed = 0
            for k, stop in enumerate(self._stops):
                state, failure = self._state[k], self._failure[k]
                while state and stop[state] != char:
                    state = failure[state - 1]
                state += stop[state] == char
                if state == len(stop):
                    completed = max(completed, state)
                    state = failure[state - 1]
                self._state[k] = state
            if completed:
                return i + 1, completed
        return None

    @property
    def partial(self) -> int:
        """Characters at the end of the text that are the start of some stop string."""
        return max(self._state, default=0)


def _failure_function(pattern: str) -> list[int]:
    failure, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = failure[k - 1]
        k += pattern[i] == pattern[k]
        failure[i] = k
    return failure


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
        self._ids = self._whole_characters(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # decoding windows start here
        self._read = len(self._ids)  # the text of ids[prefix:read] is already accounted for
        self._stops = StopMatcher(stop) if stop else None
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
        held = 0 if final or self.stopped or self._stops is None else self._stops.partial
        end = len(self.text) - held
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
        pending = len(self._ids) - self._read
        if after.endswith(_UNFINISHED) and pending < _MAX_CHARACTER_BYTES and not final:
            return ""  # wait for the rest of the character
        if len(after) <= len(before):
            # tokens that add no text (skipped special tokens): emit nothing, keep a short window
            self._read = len(self._ids)
            self._prefix = max(self._prefix, self._read - _CONTEXT_TOKENS)
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _append(self, chunk: str) -> None:
        if not chunk:
            return
        match = self._stops.feed(chunk) if self._stops is not None else None
        if match is None:
            self.text += chunk
            return
        end, length = match
        text = self.text + chunk[:end]
        self.text = text[: len(text) - length]
        self.stopped = True
