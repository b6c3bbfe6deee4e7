"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regex, a
choice among strings, or a grammar (xgrammar's EBNF), one token bitmask per constrained row per
step.

Compiled with xgrammar (benchmarks/structured_outputs.py; chosen over llguidance by measurement on
SmolLM2's 49,152-token vocabulary: 5 us against ~100 us to fill one row's next-token mask, the
cost paid every step). A compile happens where the request is made, never on the engine thread,
and its result is kept by the constraint's hash: the same schema compiles once.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from loraplex.engine.errors import InvalidRequestError, shown

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARACTERS = 100_000
MAX_CHOICES = 1000
CACHE_ENTRIES = 512
# for each byte value, what its 8 bits add to 8 logits: 0 where the bit allows, -inf where not
_ADDITIVE = torch.where(
    (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1, 0.0, float("-inf")
).float()
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint. `spec`: the schema (JSON text), the regex, the grammar, or the choices
    (a JSON list of strings); None for json_object."""

    kind: str
    spec: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise _invalid(f"structured output kind must be one of {KINDS}, got {shown(self.kind)}")
        if self.kind == "json_object":
            if self.spec is not None:
                raise _invalid("a json_object constraint takes no spec")
            return
        if not isinstance(self.spec, str) or not self.spec:
            raise _invalid(
                f"a {self.kind} constraint needs a non-empty string, got {shown(self.spec)}"
            )
        if len(self.spec) > MAX_SPEC_CHARACTERS:
            raise _invalid(f"a {self.kind} constraint is at most {MAX_SPEC_CHARACTERS} characters")

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutput:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise _invalid(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise _invalid(f"a JSON schema must be an object, got {shown(schema)}")
        # property order is kept: the output follows it
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        ok = isinstance(choices, list | tuple) and all(isinstance(c, str) and c for c in choices)
        if not ok or not choices:
            raise _invalid(
                f"choices must be a non-empty list of non-empty strings, got {shown(choices)}"
            )
        if len(choices) > MAX_CHOICES:
            raise _invalid(f"at most {MAX_CHOICES} choices, got {len(choices)}")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        return cls("grammar", ebnf)

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.spec or ''}".encode()).hexdigest()


def _invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="structured_outputs")


class Grammars:
    """Compiles constraints for one tokenizer and keeps the results (LRU, by constraint hash).
    Any thread."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    def is_cached(self, constraint: StructuredOutput) -> bool:
        with self._lock:
            return constraint.key in self._compiled

    def compile(self, constraint: StructuredOutput):
        """-> the compiled grammar. Raises InvalidRequestError naming what is wrong."""
        key = constraint.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiled = self._compile(constraint)
        with self._lock:
            self._compiled[key] = compiled
            self.num_compiles += 1
            while len(self._compiled) > CACHE_ENTRIES:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, constraint: StructuredOutput):
        compiler, kind, spec = self._compiler, constraint.kind, constraint.spec
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                # each choice a literal of the grammar; JSON's string escapes are EBNF's
                alternatives = " | ".join(json.dumps(c) for c in json.loads(spec))
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as error:
            # xgrammar's messages start with a timestamp and its source file: drop those
            detail = _SOURCE_PREFIX.sub("", (str(error).strip().splitlines() or [""])[0])[:300]
            raise _invalid(f"the {kind.replace('_', ' ')} cannot be served: {detail}") from None

    def matcher(self, compiled) -> Matcher:
        return Matcher(self._xgr.GrammarMatcher(compiled))


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    @property
    def finished(self) -> bool:
        return self._matcher.is_terminated()


class Masks:
    """The token bitmasks of one step's constrained sequences, filled on a worker thread while
    the model runs (xgrammar releases the GIL; a row costs 5-350 us depending on where the
    grammar stands, up to several ms a step for a batch)."""

    _filler = ThreadPoolExecutor(1, thread_name_prefix="loraplex-grammar")

    def __init__(self, matchers: list[Matcher], vocab_size: int) -> None:
        self._slots = {id(m): slot for slot, m in enumerate(matchers)}
        self._bitmask = self._filler.submit(self._fill, matchers, vocab_size)

    @staticmethod
    def _fill(matchers: list[Matcher], vocab_size: int) -> torch.Tensor:
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
        for slot, matcher in enumerate(matchers):
            matcher.fill(bitmask, slot)
        return bitmask  # int32 [rows, ceil(vocab / 32)]

    def apply(self, logits: torch.Tensor, matchers: list[Matcher | None]) -> None:
        """Logits [rows, vocab] float32 of tokens the grammar disallows set to -inf, in place,
        in the rows that have a matcher (filled here); the other rows are not touched.

        Each byte of the bitmask is looked up in a table of 8 additive values (0 or -inf) and
        the result added to its row: 0.3 ms for 16 rows of SmolLM2's vocabulary, against 3.3 ms
        for xgrammar's CPU apply and 3.0 ms for a boolean mask and masked_fill."""
        bitmask = self._bitmask.result()
        vocab = logits.shape[1]
        with torch.inference_mode():  # logits come from the forward pass, an inference tensor
            # little-endian: byte k of word w holds the bits of tokens 32 w + 8 k .. 32 w + 8 k + 7
            codes = bitmask.view(torch.uint8).view(-1).int()
            additive = _ADDITIVE.index_select(0, codes).view(bitmask.shape[0], -1)
            for row, matcher in enumerate(matchers):
                if matcher is not None:
                    logits[row].add_(additive[self._slots[id(matcher)], :vocab])
