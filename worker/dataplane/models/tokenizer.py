"""A byte-level tokenizer for the random-weight presets: no download, every string round-trips."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""ByteTokenizer.apply_chat_template's format as a Jinja template (for engines that read tokenizer files)."""


def _byte_symbols() -> dict[int, str]:
    """The printable character standing for each byte in byte-level BPE vocabularies (GPT-2's table)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = {byte: chr(byte) for byte in kept}
    extra = 0
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def byte_level_tokenizer() -> Any:
    """ByteTokenizer as tokenizer files: a byte-level BPE with no merges, so every id is the one
    ByteTokenizer gives (byte + 3; 0 pad, 1 begins, 2 ends), a sequence starts with <s>, and the
    chat template is the same. Saved beside a preset's weights, it lets any engine that loads a
    checkpoint directory (vLLM included) read the same prompts as the same token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({symbol: byte + BYTE_OFFSET for byte, symbol in _byte_symbols().items()})
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    model.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
