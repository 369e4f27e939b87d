"""Model presets with random weights (no download) and checkpoints, local or in the hub cache, via transformers."""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

from worker.dataplane.layout import ModelProfile, dtype_name, parse_dtype
from worker.dataplane.models.checkpoints import (
    Checkpoint,
    checkpoint_revision,
    hub_checkpoint,
    is_repo_id,
    local_checkpoint,
)
from worker.dataplane.models.tokenizer import BYTE_OFFSET, ByteTokenizer, byte_level_tokenizer
from worker.dataplane.prefix.attention import register as register_attention

log = logging.getLogger("strata.engine")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
"""Any one of these in a checkpoint directory means it ships its own tokenizer."""


@dataclasses.dataclass(frozen=True)
class Preset:
    family: str  # llama, qwen2, mistral
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    sliding_window: int | None = None
    """Attention over the last `sliding_window` tokens only, on every layer (mistral family)."""


PRESETS: dict[str, Preset] = {
    "tiny": Preset("llama", 64, 2, 4, 2, 128, 512, 4096, "float32"),
    "tiny-qwen2": Preset("qwen2", 64, 2, 4, 2, 128, 512, 4096, "float32"),
    "tiny-mistral": Preset("mistral", 64, 2, 4, 2, 128, 512, 4096, "float32"),
    # Sliding-window attention on every layer, a window of 64 tokens: a KV cache vLLM keeps in
    # part only, which the vLLM connector refuses at start.
    "tiny-sliding": Preset("mistral", 64, 2, 4, 2, 128, 512, 4096, "float32", sliding_window=64),
    "small": Preset("llama", 256, 4, 8, 2, 688, 4096, 16384, "float32"),
    "small-deep": Preset("llama", 256, 16, 8, 2, 688, 4096, 16384, "float32"),
    "bench": Preset("llama", 1024, 8, 16, 4, 2816, 32000, 16384, "bfloat16"),
    # The bench model with Llama-3-8B's 32 layers: layer-wise loading waits for the first layer
    # before any compute, 1/layers of the load, which 8 layers make an eighth of it.
    "bench-deep": Preset("llama", 1024, 32, 16, 4, 2816, 32000, 16384, "bfloat16"),
}
_CONFIGS: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}


@dataclasses.dataclass
class LoadedModel:
    """A model ready to serve, with what the KV cache of every block of it looks like."""

    name: str
    model: PreTrainedModel
    tokenizer: Any
    dtype: torch.dtype
    device: torch.device
    layers: int
    kv_heads: int
    head_dim: int
    max_context: int
    rope_theta: float
    revision: str

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    def encode(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.encode(text)
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.apply_chat_template(messages)
        if getattr(self.tokenizer, "chat_template", None):
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))

    def profile(self, block_tokens: int) -> ModelProfile:
        """What this model's KV blocks are: the profile its model key hashes."""
        return ModelProfile(
            model_id=self.name,
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=dtype_name(self.dtype),
            block_tokens=block_tokens,
            revision=self.revision,
            rope_theta=self.rope_theta,
        )


def _shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformer config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def resolve_checkpoint(
    spec: str | Path, *, revision: str | None = None, environ: Mapping[str, str] | None = None
) -> Checkpoint:
    """The checkpoint a model option that is not a preset names: an existing local directory,
    else a hub repository id (`org/name`, at `revision`: default main) resolved through the local
    hub cache, offline. Every way in (our engine, vLLM's connector, the node) goes through here,
    so each names one model alike. ValueError saying what is wrong otherwise."""
    if Path(spec).is_dir():
        return local_checkpoint(spec)
    if is_repo_id(str(spec)):
        return hub_checkpoint(str(spec), revision=revision, environ=environ)
    raise ValueError(
        f"model: {str(spec)!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a local directory nor a "
        f"hub repository id (org/name)"
    )


def _revision(checkpoint: Checkpoint, config: PretrainedConfig, cache_dir: str | Path) -> str:
    """The hub commit hash where there is one (transformers finds it too, in a snapshot's path),
    else the checkpoint's content digest."""
    return (
        checkpoint.commit
        or getattr(config, "_commit_hash", None)
        or checkpoint_revision(checkpoint.path, cache_dir=cache_dir)
    )


def checkpoint_profile(
    spec: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    block_tokens: int,
    revision: str | None = None,
    cache_dir: str | Path = "",
) -> ModelProfile:
    """The model profile of a checkpoint (a directory or a hub id, `resolve_checkpoint`) without
    loading its weights: the one `load_model(spec).profile(block_tokens)` gives, so an engine that
    loads the weights itself (vLLM) keys its blocks as Strata's own engine does. `dtype` is the
    dtype the engine runs in (default: the checkpoint's); `revision` the hub revision of a hub id;
    `cache_dir` where a read-only checkpoint's content digest is kept (`checkpoint_revision`)."""
    checkpoint = resolve_checkpoint(spec, revision=revision)
    config = AutoConfig.from_pretrained(checkpoint.path, local_files_only=True)
    layers, kv_heads, head_dim = _shape(config)
    chosen = dtype if dtype is not None else (getattr(config, "dtype", None) or "float32")
    return ModelProfile(
        model_id=checkpoint.model_id,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype_name(parse_dtype(chosen)),
        block_tokens=block_tokens,
        revision=_revision(checkpoint, config, cache_dir),
        rope_theta=_rope_theta(config),
    )


def checkpoint_config(spec: str | Path, *, revision: str | None = None) -> dict[str, Any]:
    """The config of a checkpoint (a directory or a hub id, `resolve_checkpoint`) as its
    config.json gives it, through transformers."""
    checkpoint = resolve_checkpoint(spec, revision=revision)
    return dict(AutoConfig.from_pretrained(checkpoint.path, local_files_only=True).to_dict())


def preset_checkpoint(name: str, directory: str | Path) -> Path:
    """The checkpoint of preset `name` under `directory` (`directory/name`), saved there the first
    time (`save_preset`); processes that ask at once save it once."""
    path = (Path(directory) / name).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            save_preset(name, path)
    return path


def save_preset(name: str, path: str | Path, *, seed: int = 0) -> Path:
    """Save a preset as a checkpoint directory: its random weights (those `load_model(name, seed=seed)`
    makes) as safetensors, its config, and the byte tokenizer as tokenizer files with its chat
    template, so an engine that loads checkpoints (vLLM) serves the very model and token ids of the
    preset. Writes into a temporary directory beside `path` and renames it, so a half-written
    checkpoint never stands under the name."""
    path = Path(path)
    loaded = load_model(name, seed=seed, device="cpu")
    config = loaded.model.config
    config._attn_implementation = "sdpa"  # the registered Strata attention is a name only this process knows
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if staging.exists():
        shutil.rmtree(staging)
    loaded.model.save_pretrained(staging, safe_serialization=True)
    byte_level_tokenizer().save_pretrained(staging)
    if path.exists():
        shutil.rmtree(path)
    os.replace(staging, path)
    log.info("preset %s saved as a checkpoint at %s", name, path)
    return path


def _rope_theta(config: PretrainedConfig) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0) if isinstance(params, dict) else 10000.0
    return float(theta)


def _describe(name: str, model: PreTrainedModel, tokenizer: Any, device: torch.device, revision: str) -> LoadedModel:
    config = model.config
    layers, kv_heads, head_dim = _shape(config)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        dtype=next(model.parameters()).dtype,
        device=device,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=config.max_position_embeddings,
        rope_theta=_rope_theta(config),
        revision=revision,
    )


def preset_config(name: str, *, dtype: str | None = None) -> PretrainedConfig:
    if name not in PRESETS:
        raise ValueError(
            f"model: unknown preset {name!r}; presets are {', '.join(sorted(PRESETS))}, or give a local path"
        )
    preset = PRESETS[name]
    # The config classes take these (their fields, and attn_implementation as an extra keyword);
    # typed as PretrainedConfig, which declares none of them.
    config = _CONFIGS[preset.family](  # type: ignore[call-arg]
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        intermediate_size=preset.intermediate_size,
        vocab_size=preset.vocab_size,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype=dtype or preset.dtype,
        attn_implementation=register_attention(),
    )
    if preset.sliding_window is not None:
        config.sliding_window = preset.sliding_window
    return config


def _checkpoint_tokenizer(path: Path, vocab_size: int) -> Any:
    """The checkpoint's own tokenizer, or the byte tokenizer for a checkpoint that ships none.

    Tokenizer files that fail to load are an error, never a reason to fall back: the byte
    tokenizer's ids would mean nothing to a model trained on another vocabulary."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        if vocab_size < 256 + BYTE_OFFSET:
            raise ValueError(
                f"model: {path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) and its "
                f"vocabulary of {vocab_size} ids is too small for the byte tokenizer "
                f"({256 + BYTE_OFFSET} needed)"
            )
        log.warning("model %s has no tokenizer files; using the byte tokenizer", path)
        return ByteTokenizer(vocab_size)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own untyped errors; each becomes one
        raise ValueError(f"model: the tokenizer files of {path} could not be loaded: {exc}") from exc
    if len(tokenizer) > vocab_size:
        # Ids past the embedding would fail the request that uses them, not the load.
        log.warning("model %s: its tokenizer has %d ids, the model's vocabulary %d", path, len(tokenizer), vocab_size)
    return tokenizer


def load_model(
    spec: str,
    *,
    dtype: str | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    cache_dir: str | Path = "",
) -> LoadedModel:
    """A preset name (random weights from `seed`, byte tokenizer), a local checkpoint directory or
    a hub repository id in the local hub cache (`resolve_checkpoint`); `cache_dir` is where a
    read-only checkpoint's content digest is kept (`checkpoint_revision`)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(sorted(DTYPES))}, got {dtype!r}")
    if spec in PRESETS:
        config = preset_config(spec, dtype=dtype)
        torch_dtype = DTYPES[dtype or PRESETS[spec].dtype]
        generator_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        finally:
            torch.random.set_rng_state(generator_state)
        tokenizer: Any = ByteTokenizer(config.vocab_size)
        revision = f"random-seed-{seed}"
        name = spec
    else:
        checkpoint = resolve_checkpoint(spec)
        path = checkpoint.path
        # The tokenizer first: a checkpoint whose tokenizer cannot load fails before its weights are read.
        tokenizer = _checkpoint_tokenizer(path, AutoConfig.from_pretrained(path, local_files_only=True).vocab_size)
        model = AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            dtype=DTYPES[dtype] if dtype else "auto",
            attn_implementation=register_attention(),
        )
        revision = _revision(checkpoint, model.config, cache_dir)
        name = checkpoint.model_id
    model.to(device)
    model.eval()
    loaded = _describe(name, model, tokenizer, device, revision)
    log.info(
        "model %s loaded: %d layers, %d kv heads x %d, %s on %s",
        name,
        loaded.layers,
        loaded.kv_heads,
        loaded.head_dim,
        str(loaded.dtype).removeprefix("torch."),
        device,
    )
    return loaded
