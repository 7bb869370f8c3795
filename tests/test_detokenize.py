"""Streamed text pieces never split a UTF-8 character."""

from __future__ import annotations

from mlx_lm.tokenizer_utils import load as load_tokenizer


def test_pieces_are_whole_characters(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    text = "thé naïve café — 東京 🌍 in the end"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) > len(text.encode()) // 2  # byte-level: multi-byte chars span tokens
    detokenizer = tokenizer.detokenizer
    pieces = []
    for token in tokens:
        detokenizer.add_token(token)
        if piece := detokenizer.last_segment:
            pieces.append(piece)
    detokenizer.finalize()
    pieces.append(detokenizer.last_segment)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
