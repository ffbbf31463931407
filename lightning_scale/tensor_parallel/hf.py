"""Built-in plans: a model's own ``tensor_parallel_plan()`` (the project GPT), Hugging Face models' own
``tp_plan``, and Hugging Face GPT-2.

Nothing here imports a model: a model provides its plan through ``tensor_parallel_plan(sequence_parallel)``
(the project GPT does, from :data:`GPT_PLAN`). Nothing here imports ``transformers``
either: a Hugging Face model is recognised by its ``config.model_type``
and ``base_model_prefix`` (duck typing), so the package works without it installed.

* A Hugging Face model that declares a plan (``model.tp_plan``, assembled by ``transformers`` from the
  class' ``_tp_plan`` and ``config.base_model_tp_plan`` with the right prefixes) is used as declared.
  Its style names (``colwise``, ``rowwise``, ``colwise_gather_output``, ``rowwise_split_input``,
  ``replicated_with_grad_allreduce``, ``embedding_rowwise``, ``packed_colwise``...) map onto ours with
  transformers' semantics (:func:`~lightning_scale.tensor_parallel.styles.hf_style`: its ``colwise`` is a
  contiguous split); patterns of that plan that match no module (optional layers of
  other configurations) are skipped.
* StableLM declares none either but has the Llama layout: transformers' Llama plan (:data:`LLAMA_LAYOUT_PLAN`; with
  ``qk_layernorm=True``, per-head norm lists it does not split, refused by name); so does BitNet, plus its sub-layer
  RMSNorms over the split features (style ``rmsnorm_split``).
* GPT-2 declares no plan; its fused ``c_attn`` is a ``Conv1D`` (weight stored ``(in, out)``) holding
  ``[q | k | v]``, which the ``colwise`` style detects and splits per head.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.tensor_parallel.styles import hf_style

GPT_PLAN: Dict[str, str] = {
    "wte": "vocab",
    "blocks.*.attn.qkv": "colwise",  # fused [q|k|v], split per head
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "lm_head": "vocab_colwise",  # logits stay split over the vocabulary
}

GPT2_BASE_PLAN: Dict[str, str] = {
    "wte": "vocab",
    "h.*.attn.c_attn": "colwise",  # Conv1D, fused [q|k|v], split per head
    "h.*.attn.c_proj": "rowwise",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}


class LocalHeadsConfig:
    """One attention's view of a shared Hugging Face config: the head counts of this tp rank (``local``), every
    other attribute read from and written to the shared config (so ``_attn_implementation`` switches still reach
    it). Phi3's attention cuts its fused ``qkv_proj`` output at ``config.num_attention_heads * head_dim``."""

    def __init__(self, base, local: Dict[str, int]) -> None:
        self.__dict__.update(_base=base, _local=dict(local))

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_base", "_local"):  # copy / pickle probes on a half-built object
            raise AttributeError(name)
        local = self.__dict__["_local"]
        return local[name] if name in local else getattr(self._base, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._local:
            raise AttributeError(f"{name} is this tensor-parallel rank's head count ({self._local[name]}); "
                                 "set it on the model's config before tensor parallelism is applied")
        setattr(self._base, name, value)

    def __repr__(self) -> str:
        return f"LocalHeadsConfig({self._local}, base={type(self._base).__name__})"


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "base_model_prefix") and hasattr(getattr(model, "config", None), "model_type")


def _base_prefix(model: nn.Module) -> str:
    base = getattr(model, "base_model", model)
    if base is model:
        return ""
    for name, module in model.named_modules():
        if module is base:
            return name + "."
    return ""


def _module_name(model: nn.Module, target) -> str:
    return next((n for n, m in model.named_modules() if m is target), "")


def _untie_head(plan: Dict[str, object], model: nn.Module) -> Dict[str, object]:
    """A head tied to an input embedding the plan keeps whole (Gemma, tied Llama: ``lm_head`` is
    ``colwise_gather_output`` but ``embed_tokens`` is unplanned) stays whole too: one tensor cannot be split
    in one module and whole in the other. Transformers' own plans do the same on tied weights."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_in) and callable(get_out)):
        return plan
    emb, head = get_in(), get_out()
    if emb is None or head is None or getattr(emb, "weight", None) is not getattr(head, "weight", 0):
        return plan
    emb_name, head_name = _module_name(model, emb), _module_name(model, head)
    if any(_matches(p, emb_name) for p in plan):
        return plan
    return {p: v for p, v in plan.items() if not _matches(p, head_name)}


def _matches(pattern: str, name: str) -> bool:
    import re

    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


# Families whose configs declare no tp plan although their layers have the Llama layout (``q / k / v / o_proj``,
# ``gate / up / down_proj``): transformers' Llama plan, checked for each against one process by the test matrix
# (tests/dist/test_hf_matrix.py); model type -> config flags that add layers this plan does not split (refused by name)
LLAMA_LAYOUT_PLAN: Dict[str, str] = {
    "embed_tokens": "embedding_rowwise", "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}
# model type -> (config flags refused, entries added to the Llama plan)
_LLAMA_LAYOUT = {"stablelm": (("qk_layernorm",), {}),
                 # Falcon-H1: its config's plan names the embedding only; attention q / k / v / o_proj as Llama's (its
                 # MLP is `feed_forward`, split by hf_rules.mlps_left_out; its Mamba-2 mixers by mamba.py)
                 "falcon_h1": ((), {}),
                 # HunYuan dense: its config's plan names the embedding only (every layer stayed whole at tp=2); its
                 # q / k norms over head_dim run on this rank's heads: their gradients summed over tp (as Qwen3's plan
                 # does for its q / k norms; left out, its tp2 rows were 6.7e-6 off)
                 "hunyuan_v1_dense": ((), {"layers.*.self_attn.query_layernorm": "replicated_with_grad_allreduce",
                                           "layers.*.self_attn.key_layernorm": "replicated_with_grad_allreduce"}),
                 # BitNet: an RMSNorm over the attention's output (every head) and over the MLP's intermediate, between
                 # the column- and the row-parallel layers: kept split, the mean square summed over tp (norms.py)
                 "bitnet": ((), {"layers.*.self_attn.attn_sub_norm": "rmsnorm_split",
                                 "layers.*.mlp.ffn_sub_norm": "rmsnorm_split"})}


def _llama_layout_plan(model: nn.Module, prefix: str) -> Dict[str, object]:
    refused, extra = _LLAMA_LAYOUT[model.config.model_type]
    flags = [f for f in refused if getattr(model.config, f, False)]
    if flags:
        raise ConfigError(f"tensor.plan: {type(model).__name__} with config.{flags[0]}=True: the built-in plan (the "
                          f"Llama layout its config lacks a plan for) does not split those layers; pass "
                          f"plan={{pattern: style}}")
    plan = {prefix + k: hf_style(v, k) for k, v in {**LLAMA_LAYOUT_PLAN, **extra}.items()}
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        plan["lm_head"] = hf_style("colwise_gather_output", "lm_head")  # as transformers' LlamaForCausalLM
    return _untie_head(plan, model)


# Falcon declares no tp plan. With the new decoder architecture its fused query_key_value holds, per key / value head,
# that group's queries then its key and value, so a contiguous split of its rows over tp is a split by whole groups
# (the attention's num_heads / num_kv_heads are made local like every attention's); the old layout without
# multi-query interleaves q / k / v per head (whole heads again). Refused by name: multi-query with the old layout
# (one key / value head after all the queries) and ALiBi (the base model adds every head's bias onto the mask).
FALCON_PLAN: Dict[str, str] = {
    "word_embeddings": "embedding_rowwise", "h.*.self_attention.query_key_value": "colwise",
    "h.*.self_attention.dense": "rowwise", "h.*.mlp.dense_h_to_4h": "colwise", "h.*.mlp.dense_4h_to_h": "rowwise",
}


def _falcon_plan(model: nn.Module, prefix: str) -> Dict[str, object]:
    config = model.config
    why = ("config.alibi=True: the base model adds every head's ALiBi bias onto the attention mask" if config.alibi
           else "config.multi_query=True with the old decoder layout: its one key / value head follows all the "
                "queries in query_key_value, which a split by rows would cut" if (
                    config.multi_query and not config.new_decoder_architecture) else None)
    if why:
        raise ConfigError(f"tensor.plan: {type(model).__name__} with {why}; train it with ZeRO / pp, or pass "
                          f"plan={{pattern: style}} of your own")
    return _built_in_plan(model, prefix, FALCON_PLAN)


# DBRX declares no tp plan (its class's lm_head entry only): its fused Wqkv ``[q | k | v]`` is split per part by
# whole heads (style qkv_colwise; the parts from the attention's head counts), out_proj by rows; its experts get
# style ``experts`` from the built-in rules (every expert's ffn_hidden_size rows cut over tp, experts.py)
DBRX_PLAN: Dict[str, str] = {
    "wte": "embedding_rowwise", "blocks.*.norm_attn_norm.attn.Wqkv": "qkv_colwise",
    "blocks.*.norm_attn_norm.attn.out_proj": "rowwise",
}


# Mamba (Mamba-1 only) declares no tp plan at all: its embedding split over the vocabulary here, every mixer by the
# built-in rules (style mamba1: its channels cut over tp, mamba.py), the head as every family's
MAMBA_PLAN: Dict[str, str] = {"embeddings": "embedding_rowwise"}


def _built_in_plan(model: nn.Module, prefix: str, layout: Dict[str, str]) -> Dict[str, object]:
    plan = {prefix + k: hf_style(v, k) for k, v in layout.items()}
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        plan["lm_head"] = hf_style("colwise_gather_output", "lm_head")
    return _untie_head(plan, model)


def _local_params(plan: Dict[str, str], model: nn.Module) -> Dict[str, str]:
    """transformers' ``local_params`` on a module whose own parameters the plan then names ``colwise`` (MiMo-V2-Flash:
    ``self_attn`` and ``self_attn.sinks``, one sink per head): the module gets style ``head_params`` (its per-head
    parameters cut by heads, :mod:`~lightning_scale.tensor_parallel.head_params`) and the parameter entries, which
    name no module, go. Any other ``local_params`` stays, refused by name with the styles not implemented here."""
    out = dict(plan)
    modules = dict(model.named_modules())
    for key, style in plan.items():
        if style != "local_params":
            continue
        leaves = {k[len(key) + 1:] for k in plan if k.startswith(key + ".") and "." not in k[len(key) + 1:]}
        own = {leaf for leaf in leaves if any(_matches(key, n) and leaf in m._parameters for n, m in modules.items())}
        if own:
            out[key] = "head_params"
            for leaf in own:
                out.pop(f"{key}.{leaf}", None)
    return out


def _own_experts(plan: Dict[str, str]) -> Dict[str, str]:
    """A declared plan without transformers' ``moe_tp_experts`` entries (Llama 4's experts module: every expert's
    width split, the output all-reduced): the built-in plan gives each experts module tp can split this package's
    own ``experts`` (the same split) or, with ``expert_parallel``, places its experts
    (:func:`~lightning_scale.tensor_parallel.experts.expert_plan_entries`); the entries naming its 3-D parameters
    match no module and are skipped."""
    return {k: v for k, v in plan.items() if v != "moe_tp_experts"}


# model type -> why its declared tp plan cannot run split, or why no plan can (refused by name instead of a shape error
# inside the forward, or a split that runs wrong)
BROKEN_PLANS = {"jetmoe": "its attention is a mixture of attention heads (each expert's query and output "
                          "projections stacked in a JetMoeParallelExperts, routed per token) and its MLP a mixture "
                          "of experts of the same kind: no tensor-parallel layout splits them here",
                "doge": "its declared plan splits the key / value heads but leaves the dynamic mask (dt_proj's output "
                        "and A: one value per key / value head) whole, so the mask does not match the local heads",
                "codegen": "its fused qkv_proj is laid out in model-parallel blocks that its forward re-cuts by "
                           "a fixed count (mp_num = 4) whatever the rows a rank holds (split as declared, tp=2 losses "
                           "were 1.1e-2 off one process, silently)"}


def hf_plan(model: nn.Module) -> Dict[str, str]:
    """The plan of a Hugging Face model: GPT-2's built-in one; a built-in one for the families whose declared plan
    splits no layer (StableLM, BitNet, HunYuan dense: the Llama layout; Falcon; DBRX; Mamba); else the model's declared
    ``tp_plan``. (:func:`~lightning_scale.tensor_parallel.plan.plan_tensor_parallel` then adds the experts and the
    MLPs a plan leaves out, :mod:`~lightning_scale.tensor_parallel.hf_rules`.)"""
    prefix = _base_prefix(model)
    if model.config.model_type in BROKEN_PLANS:
        raise ConfigError(f"tensor.plan: {type(model).__name__}: {BROKEN_PLANS[model.config.model_type]}; "
                          f"train it with ZeRO / pp, or pass plan={{pattern: style}} of your own")
    if model.config.model_type == "gpt2":
        plan = {prefix + k: v for k, v in GPT2_BASE_PLAN.items()}
        if isinstance(getattr(model, "lm_head", None), nn.Linear):
            plan["lm_head"] = "colwise_gather"  # HF computes the loss from full logits
        return plan
    declared = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    base = getattr(model.config, "base_model_tp_plan", None)
    if not any("*" in p for p in {**(declared or {}), **(base or {})}):  # a declared plan that splits no layer
        if model.config.model_type in _LLAMA_LAYOUT:
            return _llama_layout_plan(model, prefix)
        if model.config.model_type == "falcon":
            return _falcon_plan(model, prefix)
        if model.config.model_type == "dbrx":  # its class names the head only
            return _built_in_plan(model, prefix, DBRX_PLAN)
        if model.config.model_type == "mamba":  # no plan at all
            return _built_in_plan(model, prefix, MAMBA_PLAN)
    if declared:
        declared = _local_params(_own_experts(dict(declared)), model)
        return _untie_head({k: hf_style(v, k) for k, v in declared.items()}, model)
    if base:
        base = _local_params({prefix + k: v for k, v in _own_experts(base).items()}, model)
        return _untie_head({k: hf_style(v, k) for k, v in base.items()}, model)
    raise ConfigError(f"tensor.plan: {type(model).__name__} declares no tp_plan (base_model_tp_plan); "
                      f"pass plan={{pattern: style}}")


def _provides_plan(model: nn.Module) -> bool:
    return callable(getattr(model, "tensor_parallel_plan", None))


def default_plan(model: nn.Module, sequence_parallel: bool = False) -> Dict[str, object]:
    """The built-in plan for ``model``; ConfigError when there is none."""
    if _provides_plan(model):
        return dict(model.tensor_parallel_plan(sequence_parallel))
    if is_hf_model(model):
        return hf_plan(model)
    raise ConfigError(f"tensor.plan: no built-in tensor-parallel plan for {type(model).__name__}; pass "
                      f"plan={{'blocks.*.attn.qkv': 'colwise', ...}} or define tensor_parallel_plan() on the model")


def find_plannable_module(root: nn.Module) -> Tuple[str, nn.Module]:
    """The outermost submodule of ``root`` with a built-in plan (``tensor_parallel_plan()``, e.g. the project
    GPT, or a Hugging Face model).

    A Lightning strategy uses it to split the model a LightningModule holds (``self.model = GPT(...)``)
    when the user gave no plan: ``name, model = find_plannable_module(lightning_module)``.
    """
    for name, module in root.named_modules():  # pre-order: outermost first
        if _provides_plan(module) or is_hf_model(module):
            return name, module
    raise ConfigError(f"tensor.plan: {type(root).__name__} contains no module with a built-in tensor-parallel "
                      f"plan (the project GPT or a Hugging Face model); pass tensor.plan={{pattern: style}}")
