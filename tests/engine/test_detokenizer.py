"""Incremental detokenization: multi-byte characters and stop strings."""

from __future__ import annotations

from tokenizers import Tokenizer

from loraplex.engine.detokenizer import IncrementalDetokenizer


def stream(tokenizer: Tokenizer, text: str, stop: list[str], prompt: str = "say:"):
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt).ids, stop, True)
    pieces = []
    for token in ids:
        detok.add_token(token)
        pieces.append(detok.take_new_text(final=False))
        if detok.stopped:
            break
    pieces.append(detok.take_new_text(final=True))
    return pieces, detok


def test_multibyte_characters_split_across_tokens_stream_exactly(tiny_tokenizer_dir):
    tokenizer = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    text = " café 語京 🚀😀🚀 ïüö 本東 naïve"
    ids = tokenizer.encode(text).ids
    partial = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert partial, "some characters should be split into byte tokens"
    pieces, detok = stream(tokenizer, text, stop=[])
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in piece for piece in pieces), "half a character was emitted"


def test_stop_string_is_held_back_then_cut(tiny_tokenizer_dir):
    tokenizer = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    pieces, detok = stream(tokenizer, " the river runs over the mountain", stop=["runs over"])
    assert detok.stopped
    assert "".join(pieces) == " the river "
    assert not any("run" in piece for piece in pieces)


def test_text_that_only_resembles_a_stop_string_is_released(tiny_tokenizer_dir):
    tokenizer = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    pieces, detok = stream(tokenizer, " the river runs fast", stop=["runs over"])
    assert not detok.stopped
    assert "".join(pieces) == " the river runs fast"
    # "runs " was held back while it could still become "runs over", released with "f..."
    released = next(piece for piece in pieces if "runs" in piece)
    assert "f" in released
