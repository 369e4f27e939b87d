"""Local checkpoints (`--model PATH`): a tiny Llama saved with save_pretrained, with its own
tokenizer built here (no download), loads through `load_model` and serves cache hits exactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tests.engine.conftest import BLOCK_TOKENS, engine_for
from worker.dataplane.models.loading import load_model
from worker.dataplane.models.tokenizer import ByteTokenizer

SENTENCES = [
    "strata keeps the kv cache of every block in tiers",
    "a block that is missing or corrupt is recomputed and never served",
    "the loader brings layer zero of every hit block then layer one",
    "the quick brown fox jumps over the lazy dog",
]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on a few sentences; every sequence starts with <s>."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        SENTENCES, trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def save_checkpoint(
    path: Path, *, dtype: torch.dtype = torch.float32, tokenizer: bool = True, vocab_size: int = 0, seed: int = 0
) -> PreTrainedTokenizerFast:
    """A 2-layer Llama with random weights (4 heads, 2 KV heads), saved with its tokenizer."""
    words = word_tokenizer()
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab_size or len(words),
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(dtype).save_pretrained(path)
    if tokenizer:
        words.save_pretrained(path)
    return words


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_saved_checkpoint_serves_exact_hits_with_its_own_tokenizer(tmp_path, make_store, dtype):
    saved = save_checkpoint(tmp_path / "tiny-llama", dtype=dtype)
    model = load_model(str(tmp_path / "tiny-llama"), device="cpu")
    assert (model.name, model.layers, model.kv_heads, model.head_dim) == ("tiny-llama", 2, 2, 16)
    assert model.dtype == dtype and model.max_context == 1024  # the checkpoint's own dtype ("auto")
    assert model.revision.startswith("content-")
    # The checkpoint's tokenizer, not the byte tokenizer of the presets.
    assert not isinstance(model.tokenizer, ByteTokenizer)
    text = " ".join(SENTENCES * 4)
    prompt = model.encode(text)
    assert prompt == saved(text)["input_ids"]
    assert prompt[0] == 1 and len(prompt) == len(text.split()) + 1 and max(prompt) < len(saved)
    assert prompt != ByteTokenizer(512).encode(text)
    assert model.eos_token_id == 2
    assert model.decode(model.encode("the lazy dog")[1:]) == "the lazy dog"

    engine = engine_for(model, make_store(model, ("host",)))
    cold = engine.generate(prompt, max_tokens=10, use_cache=False)
    first = engine.generate(prompt, max_tokens=10)
    warm = engine.generate(prompt, max_tokens=10)
    assert first.trace.cached_tokens == 0
    assert warm.trace.hit_blocks_by_tier == {"host": len(prompt) // BLOCK_TOKENS}
    assert warm.trace.cached_tokens == (len(prompt) // BLOCK_TOKENS) * BLOCK_TOKENS
    assert warm.output_ids == cold.output_ids == first.output_ids
    assert torch.equal(warm.first_logits, cold.first_logits)


def test_a_checkpoint_without_tokenizer_files_gets_the_byte_tokenizer(tmp_path):
    save_checkpoint(tmp_path / "bare", tokenizer=False, vocab_size=300)
    model = load_model(str(tmp_path / "bare"), device="cpu")
    assert isinstance(model.tokenizer, ByteTokenizer) and model.tokenizer.vocab_size == 300
    assert model.encode("ab") == [1, ord("a") + 3, ord("b") + 3]


def test_a_checkpoint_that_cannot_be_served_is_refused_by_name(tmp_path):
    save_checkpoint(tmp_path / "small-vocab", tokenizer=False)
    with pytest.raises(ValueError, match="has no tokenizer files .* too small for the byte tokenizer"):
        load_model(str(tmp_path / "small-vocab"), device="cpu")
    # Tokenizer files that do not load never fall back to bytes the model was not trained on.
    save_checkpoint(tmp_path / "broken")
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer files of .*broken could not be loaded"):
        load_model(str(tmp_path / "broken"), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without config.json"):
        load_model(str(tmp_path / "empty"), device="cpu")


def test_new_weights_at_the_same_path_get_a_new_revision(tmp_path):
    # The revision goes into the model key: blocks of the old weights (on disk, in Redis) must
    # never be served to the new ones.
    path = tmp_path / "ckpt"
    save_checkpoint(path, seed=1)
    before = load_model(str(path), device="cpu").revision
    assert load_model(str(path), device="cpu").revision == before  # the same files, the same revision
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    save_checkpoint(path, seed=2)
    os.utime(weights, ns=(stamp + 1_000_000_000, stamp + 1_000_000_000))  # not within one clock tick
    assert load_model(str(path), device="cpu").revision != before
