"""Byte-level tokenizer: one token per UTF-8 byte, so a learner counts tokens as bytes.

For ASCII text (every record the labs use) a token is a character.
"""

from __future__ import annotations

from dataclasses import dataclass

from minigrid_engine.errors import BadInput

VOCAB_SIZE = 256


@dataclass(frozen=True)
class ByteTokenizer:
    """Encodes text to UTF-8 byte ids and back."""

    vocab_size: int = VOCAB_SIZE

    def encode(self, text: str | bytes, what: str = "prompt") -> list[int]:
        """Token ids of `text`; raises `BadInput` naming `what` for an empty or undecodable text."""
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BadInput(
                    f"{what} is not valid UTF-8: byte 0x{text[exc.start]:02x} at offset {exc.start}"
                ) from None
        if not isinstance(text, str):
            raise BadInput(f"{what} must be a string, got {type(text).__name__}")
        if text == "":
            raise BadInput(f"{what} is empty: send at least one character")
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as exc:  # lone surrogates, e.g. from a JSON "\ud800"
            raise BadInput(
                f"{what} holds a character that is not encodable as UTF-8 at offset {exc.start}"
            ) from None

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; an incomplete multi-byte character shows as U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")
