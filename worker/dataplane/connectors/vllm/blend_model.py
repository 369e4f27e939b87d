"""vLLM's own model as fragment blending computes over it.

Selective recompute (`blend.fusion.blend_prefill`) walks a Llama-family model by the module names
of its transformers form: `model.model.embed_tokens`, `.layers[i].self_attn.{q,k,v,o}_proj`,
`.rotary_emb`, `.input_layernorm`, `.mlp`, `.post_attention_layernorm`, `.norm` and
`model.lm_head`. `VllmBlendModel` gives those names to the model vLLM serves, so that the
engine's algorithm runs unchanged on the very weights, kernels and tensor-parallel shards vLLM
computes with:

- q, k and v come from vLLM's fused `qkv_proj`, computed once per input and split (Qwen3's
  per-head q/k norms applied, as its attention does before RoPE);
- the rotary angles are the ones vLLM's own rotary embedding tabulates (its `cos_sin_cache`,
  rebuilt once in float32), read at |position| with the sine negated for a negative shift (a
  fragment moved earlier), in the hidden states' dtype for computed tokens as vLLM applies them;
- norms, MLP, output projection, embedding and logits are vLLM's modules, called on rows
  flattened to `[tokens, hidden]` as vLLM calls them; under tensor parallel each rank computes
  its own heads and the row-parallel projections reduce across ranks exactly as in vLLM's
  forward, so every rank must blend the same plan in the same step.

What this binds to in vLLM: the attribute names above on the classes in `ARCHITECTURES`, the
rotary embedding classes in `ROTARY`, and `compute_logits`. `blend_problem` names the first thing
a served model has that this was not built for (another architecture or vLLM version, a rotary
embedding that is not a pure rotation, pipeline parallel); blending is then refused at start and
the node serves prefix reuse only.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import weakref
from typing import Any

import torch

ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
"""The model classes of vLLM whose layers `VllmBlendModel` maps."""
ROTARY = frozenset({"RotaryEmbedding", "Llama3RotaryEmbedding", "LinearScalingRotaryEmbedding"})
"""vLLM's rotary embeddings whose angle is a fixed frequency times the position: a key moves to
another position by a rotation, so a fragment can be re-aligned without recomputing it."""
BUILT_FOR = ("0.32.",)
"""The vLLM releases whose module layout this was built against and tested on."""


def blend_problem(model: Any, *, vllm_version: str, pipeline_parallel: int = 1) -> str | None:
    """Why blending cannot run on `model` (vLLM's loaded model), in one line naming it, or None."""
    if not vllm_version.startswith(BUILT_FOR):
        return f"vLLM {vllm_version}: fragment blending is built for vLLM {', '.join(v + 'x' for v in BUILT_FOR)}"
    kind = type(model).__name__
    if kind not in ARCHITECTURES:
        return f"architecture {kind}: fragment blending serves {', '.join(sorted(ARCHITECTURES))}"
    if pipeline_parallel != 1:
        return f"pipeline parallel {pipeline_parallel}: fragment blending runs every layer on one rank"
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not len(layers):
        return f"architecture {kind}: its layers are not where fragment blending reads them (model.layers)"
    attn = layers[0].self_attn
    rotary = attn.rotary_emb
    if type(rotary).__name__ not in ROTARY:
        return (
            f"{kind}: its rotary embedding {type(rotary).__name__} is not a plain rotation by position, "
            "so a fragment's keys cannot be moved to a new position"
        )
    if not getattr(rotary, "is_neox_style", False) or rotary.rotary_dim != attn.head_dim:
        return f"{kind}: its rotary embedding rotates {rotary.rotary_dim} of {attn.head_dim} dimensions, or interleaved"
    if getattr(attn, "do_llama_4_scaling", False):
        return f"{kind}: its attention scales queries by position (llama 4 scaling)"
    return None


def blend_start_problem(
    architecture: str, *, vllm_version: str, tensor_parallel: int = 1, pipeline_parallel: int = 1
) -> str | None:
    """What of a vLLM server's configuration fragment blending does not serve, known before its
    model loads (the rest `blend_problem` checks on the model), or None."""
    if not vllm_version.startswith(BUILT_FOR):
        return f"vLLM {vllm_version}: fragment blending is built for vLLM {', '.join(v + 'x' for v in BUILT_FOR)}"
    if architecture not in ARCHITECTURES:
        return f"architecture {architecture}: fragment blending serves {', '.join(sorted(ARCHITECTURES))}"
    if tensor_parallel != 1 or pipeline_parallel != 1:
        return (
            f"tensor parallel {tensor_parallel}, pipeline parallel {pipeline_parallel}: "
            "fragment blending serves one rank"
        )
    return None


def _rows(module: Any, x: torch.Tensor) -> torch.Tensor:
    """`module` (one of vLLM's, which take `[tokens, features]`) on `[1, tokens, features]`."""
    out = module(x.reshape(-1, x.shape[-1]))
    if isinstance(out, tuple):  # vLLM's linear layers return (output, bias)
        out = out[0]
    return out.view(*x.shape[:-1], out.shape[-1])


class _Rows:
    """A vLLM module called as a transformers module is: on `[1, tokens, features]`."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _rows(self.module, x)


class _Norm:
    """vLLM's RMSNorm through vLLM's own compiled kernel (`_C.rms_norm`): outside the model's
    compiled graph the norm runs as separate torch operations, ten times slower on a CPU. A norm
    the kernel does not cover (no weight, a variance over part of the features) is called as it
    is."""

    def __init__(self, norm: Any) -> None:
        self.norm = norm
        ops = getattr(torch.ops, "_C", None)
        self.kernel = getattr(ops, "rms_norm", None) if ops is not None else None
        weight = getattr(norm, "weight", None)
        if (
            not isinstance(weight, torch.nn.Parameter)
            or getattr(norm, "variance_size_override", None) is not None
            or not isinstance(getattr(norm, "variance_epsilon", None), float)
        ):
            self.kernel = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return _rows(self.norm, x)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(rows)
        self.kernel(out, rows, self.norm.weight.data, self.norm.variance_epsilon)
        return out.view(x.shape)


class _Mlp:
    """vLLM's gated MLP (`gate_up_proj`, `act_fn`, `down_proj`) with its activation run eagerly:
    called outside the model's own compiled graph, vLLM's activation op compiles its native
    forward on its first call (seconds on a CPU, inside the engine step of the first blended
    request). The plain activation is what vLLM's MLP computes wherever no fused quantisation
    applies, and what its down projection always accepts. Another MLP is called as it is."""

    def __init__(self, mlp: Any) -> None:
        self.mlp = mlp
        parts = all(hasattr(mlp, name) for name in ("gate_up_proj", "act_fn", "down_proj"))
        self.act = getattr(mlp.act_fn, "forward_native", None) if parts else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is None:
            return _rows(self.mlp, x)
        hidden, _ = self.mlp.gate_up_proj(x.reshape(-1, x.shape[-1]))
        out, _ = self.mlp.down_proj(self.act(hidden))
        return out.view(*x.shape[:-1], out.shape[-1])


class _Rotary:
    """vLLM's rotary table as transformers' `rotary_emb(x, position_ids) -> (cos, sin)`:
    `[1, tokens, head_dim]` each, in `x`'s dtype, for any integer position (negative ones too)."""

    def __init__(self, rotary: Any) -> None:
        table = rotary._compute_cos_sin_cache().to(torch.float32)  # noqa: SLF001 - the table vLLM applies
        self.cos, self.sin = table.chunk(2, dim=-1)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = position_ids.reshape(-1)
        where = positions.abs().to(self.cos.device)
        if where.numel() and int(where.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(where.max())} is past the rotary table's {self.cos.shape[0]} positions")
        cos = self.cos.index_select(0, where)
        sin = self.sin.index_select(0, where) * torch.where(positions < 0, -1.0, 1.0).to(self.sin.device).unsqueeze(1)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos.to(x.device, x.dtype).unsqueeze(0), sin.to(x.device, x.dtype).unsqueeze(0)


class _Attention:
    """A layer's attention by transformers' names: q, k and v from one call of the fused projection."""

    def __init__(self, attn: Any) -> None:
        self.attn = attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.o_proj = _Rows(attn.o_proj)
        self._input: torch.Tensor | None = None
        self._qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._input is not x or self._qkv is None:
            attn = self.attn
            q, k, v = _rows(attn.qkv_proj, x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            if hasattr(attn, "q_norm"):  # Qwen3: an RMSNorm over each head's q and k, before RoPE
                q = _rows(attn.q_norm, q.reshape(*q.shape[:-1], -1, self.head_dim)).reshape(q.shape)
                k = _rows(attn.k_norm, k.reshape(*k.shape[:-1], -1, self.head_dim)).reshape(k.shape)
            self._input, self._qkv = x, (q, k, v)
        return self._qkv

    def q_proj(self, x: torch.Tensor) -> torch.Tensor:
        return self._split(x)[0]

    def k_proj(self, x: torch.Tensor) -> torch.Tensor:
        return self._split(x)[1]

    def v_proj(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(x)
        self._input = self._qkv = None  # the last of the three: nothing kept past the layer
        return v


class _Layer:
    def __init__(self, layer: Any) -> None:
        self.self_attn = _Attention(layer.self_attn)
        self.input_layernorm = _Norm(layer.input_layernorm)
        self.post_attention_layernorm = _Norm(layer.post_attention_layernorm)
        self.mlp = _Mlp(layer.mlp)


class _Base:
    def __init__(self, base: Any) -> None:
        self.layers = [_Layer(layer) for layer in base.layers]
        self.embed_tokens = base.embed_tokens
        self.norm = _Norm(base.norm)
        self.rotary_emb = _Rotary(base.layers[0].self_attn.rotary_emb)


class VllmBlendModel:
    """vLLM's loaded model under the names `blend_prefill` reads (see the module's docstring)."""

    def __init__(self, model: Any) -> None:
        self.vllm_model = model
        self.model = _Base(model.model)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of `[1, tokens, hidden]` rows, `[1, tokens, vocab]` (vLLM's logits processor)."""
        logits = self.vllm_model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))
        return logits.view(*hidden.shape[:-1], logits.shape[-1])


_loaded: list[weakref.ref[Any]] = []
"""The model the last model runner of this process loaded (`remember_loaded_models`)."""


RUNNERS = {
    "vllm.v1.worker.gpu_model_runner": "GPUModelRunner",
    "vllm.v1.worker.cpu_model_runner": "CPUModelRunner",
}
"""vLLM's model runners whose `load_model` is made to note the model it loads."""


def remember_loaded_models() -> None:
    """Make vLLM's model runners (GPU and CPU) note the model each loads, for `loaded_model`:
    vLLM hands a connector its KV cache, never its model. Called by the plugin in every vLLM
    process: a runner's module already imported is patched now, one imported later as it is
    imported (so a process that never loads a model never imports one); a second call changes
    nothing."""
    for module in RUNNERS:
        if module in sys.modules:
            _patch(sys.modules[module])
    if not any(isinstance(finder, _RunnerImports) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RunnerImports())


def _patch(module: Any) -> None:
    runner = getattr(module, RUNNERS[module.__name__], None)
    load = None if runner is None else runner.__dict__.get("load_model")
    if runner is None or load is None or getattr(load, "_strata_remembers", False):
        return

    @functools.wraps(load)
    def remembering(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load(self, *args, **kwargs)
        model = getattr(self, "model", None)
        if model is not None:
            _loaded[:] = [weakref.ref(model)]
        return result

    remembering._strata_remembers = True  # type: ignore[attr-defined]
    runner.load_model = remembering


class _RunnerImports(importlib.abc.MetaPathFinder):
    """Patches a runner's module right after it is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in RUNNERS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the module's own loader's
        return getattr(self.loader, name)


def loaded_model() -> Any | None:
    """The model vLLM's runner loaded in this process, or None (not loaded, or not noted)."""
    return _loaded[0]() if _loaded else None
