"""tokenizer.json as the grammar backends read it: one fix to what a GGUF conversion writes.

transformers 5.17 converts a GGUF file's byte-level BPE tokenizer (SmolLM2's, GPT-2's kind) with a
SentencePiece-style decoder, Sequence[ByteFallback, Fuse, Replace("▁", " "), ByteLevel], and byte_fallback
on; transformers 5.24 writes the plain ByteLevel decoder. Both decode alike where the vocabulary has no
"<0xNN>" byte tokens (ByteFallback has nothing to do) and no token holds "▁" (nor does Replace): only
ByteLevel acts. llguidance, though, guesses how tokens map to bytes from the decoder, reads the Sequence
as SentencePiece, keeps "Ġ" as itself where a space was meant and refuses valid JSON, so the engine
could not use it (grammar_backends._check_reads_alike) on hosts with the older transformers.
"""

from __future__ import annotations

import re

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_NO_OPS_FOR_BYTE_LEVEL = {"ByteFallback", "Fuse", "Replace"}


def with_byte_level_decoder(spec: dict) -> dict:
    """`spec` (a parsed tokenizer.json) with its decoder made the plain ByteLevel one where the two decode
    every token sequence alike (see the module docstring); otherwise `spec` unchanged."""
    decoder, model = spec.get("decoder") or {}, spec.get("model") or {}
    if decoder.get("type") != "Sequence" or model.get("type") != "BPE":
        return spec
    parts = decoder.get("decoders") or []
    if not parts or parts[-1].get("type") != "ByteLevel":  # last: the others see byte-level text only
        return spec
    if any(d.get("type") not in _NO_OPS_FOR_BYTE_LEVEL for d in parts[:-1]):
        return spec
    if any(d.get("type") == "Replace" and d.get("pattern") != {"String": "\u2581"} for d in parts):
        return spec
    tokens = list(model.get("vocab") or {}) + [t.get("content", "") for t in spec.get("added_tokens") or []]
    if any("\u2581" in t or _BYTE_TOKEN.match(t) for t in tokens):
        return spec
    return {**spec, "decoder": parts[-1], "model": {**model, "byte_fallback": False}}
