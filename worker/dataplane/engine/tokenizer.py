"""A byte-level tokenizer for the random-weight presets: no download, every string round-trips."""

from __future__ import annotations

from collections.abc import Sequence

BYTE_OFFSET = 3  # ids 0..2 are special


class ByteTokenizer:
    """Token id = byte value + 3; 0 is padding, 1 begins a sequence, 2 ends one."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256 + BYTE_OFFSET:
            raise ValueError(f"vocab_size: a byte tokenizer needs at least {256 + BYTE_OFFSET} ids, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        # Ids past the byte range can be sampled from a random model; they have no text.
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A plain template: one '<|role|>\\ncontent\\n' section per message, then the assistant's cue."""
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        return self.encode(text)
