"""Kimi K3 configuration: reads the release `config.json` (a top level with a nested `text_config`) as is.

The release names its text config `model_type "kimi_linear"`, which transformers also uses for a different,
incompatible model, so the nested config is always built here from its dict and never looked up in the registry.
"""

import inspect

from transformers import PretrainedConfig

MXFP4_GROUP_SIZE = 32
# The top-level class name of the published release, which SGLang and vLLM dispatch on.
RELEASE_ARCHITECTURE = "KimiK3ForConditionalGeneration"
_LINEAR_ATTN_DEFAULTS = {
    "num_heads": 96,
    "head_dim": 128,
    "short_conv_kernel_size": 4,
    "use_full_rank_gate": True,
    "gate_lower_bound": -5.0,
    "full_attn_layers": None,
    "kda_layers": None,
}
# Integer keys of the text config and the least value each may take.
_INTEGER_KEYS = {
    "vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 1, "num_experts": 1,
    "num_experts_per_token": 1, "num_shared_experts": 0, "moe_intermediate_size": 1, "routed_expert_hidden_size": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "attn_res_block_size": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "q_lora_rank": 1, "kv_lora_rank": 1, "qk_nope_head_dim": 1, "qk_rope_head_dim": 0,
    "v_head_dim": 1, "max_position_embeddings": 1,
}


# The optional CUDA implementations the model may use instead of its pure-torch reference ops, each "auto" (where
# it can run: importable, on a device that supports it, for the config's shapes), "on" (an error where it cannot) or
# "off". The model resolves them once per device (`kimi_k3_dispatch`) and logs the result in one line.
FAST_PATH_DEFAULTS = {
    "experts": "auto",  # Triton kernels that read the MXFP4 experts' bytes (mxfp4_triton.py)
    "kda": "auto",  # fla-core's recurrent KDA kernel (fp32 state): decode steps, and prompts where kda_prefill is off
    "kda_prefill": "auto",  # fla-core's chunked KDA kernel for prompts, fed fp32 (kda.py says why)
    "fused": "auto",  # Triton kernels for the depth mixes, short convs, router top-k and pair sum + norm
    "side_streams": "auto",  # a second CUDA stream for work of a block the main path does not wait on
    "cuda_graphs": "auto",  # one-token steps with a static cache replayed from a CUDA graph
    # one matmul for the projections that read the same input, over their weights merged at load (the CPU: "on" only)
    "merged_projections": "auto",
}


def check_fast_paths(fast_paths):
    """`fast_paths` with every path named and each choice spelled "auto" / "on" / "off" (True and False read as
    "on" and "off"); an unknown path or choice is an error naming it."""
    fast_paths = dict(fast_paths or {})
    unknown = sorted(set(fast_paths) - set(FAST_PATH_DEFAULTS))
    _check(not unknown, f"fast_paths has unknown path(s) {unknown}; the paths are {list(FAST_PATH_DEFAULTS)}")
    spelled = {True: "on", False: "off"}
    out = {}
    for path, default in FAST_PATH_DEFAULTS.items():
        choice = fast_paths.get(path, default)
        choice = spelled.get(choice, choice) if isinstance(choice, bool) else choice
        _check(choice in ("auto", "on", "off"), f"fast_paths[{path!r}] is {choice!r}, not 'auto', 'on' or 'off'")
        out[path] = choice
    return out


def _check(condition, message):
    if not condition:
        raise ValueError(f"Kimi K3 config: {message}")


class KimiK3TextConfig(PretrainedConfig):
    """The decoder's hyper-parameters, under the release's key names.

    `linear_attn_config.full_attn_layers` / `kda_layers` are **1-based** as in the release; `layer_types` is the
    derived 0-based list ("kda" or "mla"). `num_experts_per_layer` (ours, written by non-uniform prunes) gives the
    routed-expert count of each layer, 0 for dense layers; without it every MoE layer has `num_experts`.
    `num_experts_per_tok`, the name most Hugging Face MoE configs use, is read as an alias of `num_experts_per_token`
    (both with different values is an error); only `num_experts_per_token` is written back.
    """

    model_type = "kimi_k3_text"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=33792,
        num_hidden_layers=93,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        num_experts=896,
        num_experts_per_token=None,
        num_experts_per_layer=None,
        num_shared_experts=2,
        moe_intermediate_size=3072,
        routed_expert_hidden_size=3584,
        latent_moe_use_norm=True,
        moe_router_activation_func="sigmoid",
        moe_renormalize=True,
        routed_scaling_factor=1.0,
        topk_method="noaux_tc",
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        attn_res_block_size=12,
        num_attention_heads=96,
        num_key_value_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_nope=True,
        mla_use_output_gate=True,
        linear_attn_config=None,
        max_position_embeddings=1048576,
        rms_norm_eps=1e-5,
        num_nextn_predict_layers=0,
        initializer_range=0.02,
        tie_word_embeddings=False,
        use_cache=True,
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.num_experts = num_experts
        alias = kwargs.pop("num_experts_per_tok", None)
        if alias is not None:
            _check(
                num_experts_per_token is None or num_experts_per_token == alias,
                f"num_experts_per_tok = {alias!r} and num_experts_per_token = {num_experts_per_token!r} disagree "
                "(num_experts_per_tok is read as an alias of num_experts_per_token)",
            )
            num_experts_per_token = alias
        self.num_experts_per_token = 16 if num_experts_per_token is None else num_experts_per_token
        self.num_experts_per_layer = list(num_experts_per_layer) if num_experts_per_layer is not None else None
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.moe_router_activation_func = moe_router_activation_func
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.topk_method = topk_method
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.attn_res_block_size = attn_res_block_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.linear_attn_config = {**_LINEAR_ATTN_DEFAULTS, **(linear_attn_config or {})}
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self._check_integers()
        self.layer_types = self._derive_layer_types()
        self._validate()

    def _check_integers(self):
        """Sizes and counts are JSON integers (not strings, floats or booleans) in range, before anything uses them."""
        for name, low in _INTEGER_KEYS.items():
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value >= low,
                f"{name} must be an integer >= {low}, got {value!r}",
            )
        for i, count in enumerate(self.num_experts_per_layer or []):
            _check(
                isinstance(count, int) and not isinstance(count, bool) and count >= 0,
                f"num_experts_per_layer[{i}] must be an integer >= 0, got {count!r}",
            )

    def _derive_layer_types(self):
        """0-based "kda"/"mla" per layer from the 1-based release lists (MLA only, if neither list is given)."""
        n = self.num_hidden_layers
        full = self.linear_attn_config["full_attn_layers"]
        kda = self.linear_attn_config["kda_layers"]
        if full is None and kda is None:
            return ["mla"] * n
        full, kda = list(full or []), list(kda or [])
        for name, layers in (("full_attn_layers", full), ("kda_layers", kda)):
            bad = [i for i in layers if not isinstance(i, int) or not 1 <= i <= n]
            _check(not bad, f"linear_attn_config.{name} has layer indices {bad} outside 1..{n} (the lists are 1-based)")
        both = sorted(set(full) & set(kda))
        _check(not both, f"layers {both} are in both full_attn_layers and kda_layers")
        missing = sorted(set(range(1, n + 1)) - set(full) - set(kda))
        _check(not missing, f"layers {missing} (1-based) are in neither full_attn_layers nor kda_layers")
        kda_set = set(kda)
        return ["kda" if i + 1 in kda_set else "mla" for i in range(n)]

    def is_moe_layer(self, layer_idx):
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    def experts_in_layer(self, layer_idx):
        """Routed experts of one layer (0 for a dense layer)."""
        if not self.is_moe_layer(layer_idx):
            return 0
        if self.num_experts_per_layer is not None:
            return self.num_experts_per_layer[layer_idx]
        return self.num_experts

    def release_dict(self):
        """The nested `text_config` as the release writes it: our keys plus any non-default generic ones."""
        generic = PretrainedConfig().to_dict()
        own = set(inspect.signature(KimiK3TextConfig.__init__).parameters)
        output = {
            key: value
            for key, value in self.to_dict().items()
            if key in own or (key in generic and value != generic[key]) or key not in generic
        }
        for key in ("layer_types", "transformers_version", "architectures", "auto_map", "model_type"):
            output.pop(key, None)
        if output.get("num_experts_per_layer") is None:
            output.pop("num_experts_per_layer", None)
        return {"model_type": "kimi_linear", **output}

    def _validate(self):
        lac = self.linear_attn_config
        _check(self.hidden_act == "situ", f"hidden_act {self.hidden_act!r} is not supported (only 'situ')")
        _check(self.moe_router_activation_func == "sigmoid", "moe_router_activation_func must be 'sigmoid'")
        _check(self.topk_method == "noaux_tc", f"topk_method {self.topk_method!r} is not supported (only 'noaux_tc')")
        _check(
            self.num_expert_group == 1 and self.topk_group == 1,
            "grouped top-k with more than one group is not supported (num_expert_group = topk_group = 1)",
        )
        _check(self.mla_use_nope, "mla_use_nope must be true: Kimi K3 MLA has no rotary embedding")
        _check(self.num_nextn_predict_layers == 0, "MTP layers (num_nextn_predict_layers > 0) are not supported")
        _check(self.num_key_value_heads == self.num_attention_heads, "num_key_value_heads must equal num_attention_heads")
        _check(1 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace must be in 1..layers")
        _check(lac["short_conv_kernel_size"] >= 1, "linear_attn_config.short_conv_kernel_size must be >= 1")
        _check(lac["use_full_rank_gate"], "linear_attn_config.use_full_rank_gate must be true (K3 KDA)")
        _check(
            lac["gate_lower_bound"] is None or lac["gate_lower_bound"] < 0,
            "linear_attn_config.gate_lower_bound must be negative (or null)",
        )
        for name in ("routed_expert_hidden_size", "moe_intermediate_size"):
            value = getattr(self, name)
            _check(
                value % MXFP4_GROUP_SIZE == 0,
                f"{name} = {value} does not divide into MXFP4 groups of {MXFP4_GROUP_SIZE}",
            )
        if self.num_experts_per_layer is not None:
            counts = self.num_experts_per_layer
            _check(
                len(counts) == self.num_hidden_layers,
                f"num_experts_per_layer has {len(counts)} entries, expected num_hidden_layers = {self.num_hidden_layers}",
            )
            for i, count in enumerate(counts):
                if not self.is_moe_layer(i):
                    _check(count == 0, f"num_experts_per_layer[{i}] = {count}, but layer {i} is dense (expected 0)")
        for i in range(self.num_hidden_layers):
            experts = self.experts_in_layer(i)
            if experts:
                _check(
                    self.num_experts_per_token <= experts,
                    f"num_experts_per_token = {self.num_experts_per_token} is larger than the {experts} experts of "
                    f"layer {i}",
                )


class KimiK3Config(PretrainedConfig):
    """Top-level release config: `text_config` plus token ids, `auto_map` and the compressed-tensors block.

    `quantization_config` is kept under the internal name `expert_quantization` and written back under its release
    name, inside `text_config`, by `to_dict`: the routed experts stay packed in our own modules, and hiding the block keeps transformers'
    compressed-tensors loader (which only understands `nn.Linear` and would decompress to bf16) out of the way.
    The release allows the block at the top level or inside `text_config`; both are read.
    `fast_paths` (ours), a partial dict such as `{"experts": "off"}`, chooses the optional CUDA implementations
    (`FAST_PATH_DEFAULTS`); it is a `from_pretrained` keyword, a runtime choice, and lives in a config only where a
    user saved it there (an attribute set only when given).
    """

    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiK3TextConfig}
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        text_config=None,
        quantization_config=None,
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
        tie_word_embeddings=False,
        fast_paths=None,
        **kwargs,
    ):
        if fast_paths is not None:
            self.fast_paths = check_fast_paths(fast_paths)
        if isinstance(text_config, KimiK3TextConfig):
            text_config = text_config.to_dict()
        text_config = dict(text_config or {})
        text_config.pop("model_type", None)
        nested_quantization = text_config.pop("quantization_config", None)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            text_config.setdefault(key, locals()[key])
        self.text_config = KimiK3TextConfig(**text_config)
        self.expert_quantization = _check_quantization(quantization_config or nested_quantization)
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def experts_packed(self):
        """True when routed experts are stored as MXFP4 `weight_packed` / `weight_scale`."""
        return self.expert_quantization is not None

    def get_text_config(self, *args, **kwargs):
        return self.text_config

    def to_dict(self):
        """The release layout: the parent's architecture name (engines pick their model class by it; `auto_map`
        points Transformers at ours) and the compressed-tensors block inside `text_config`, where the parent
        keeps it."""
        output = super().to_dict()
        output["architectures"] = [RELEASE_ARCHITECTURE]
        output["text_config"] = self.text_config.release_dict()
        quantization = output.pop("expert_quantization", None)
        if quantization is not None:
            output["text_config"]["quantization_config"] = quantization
        return output


def _check_quantization(block):
    """Accept only the MXFP4 compressed-tensors block this model can run; anything else is a clear error."""
    if block is None:
        return None
    if not isinstance(block, dict):
        block = block.to_dict()
    method = block.get("quant_method")
    fmt = block.get("format")
    _check(method == "compressed-tensors", f"quantization_config.quant_method {method!r} is not 'compressed-tensors'")
    _check(fmt == "mxfp4-pack-quantized", f"quantization_config.format {fmt!r} is not 'mxfp4-pack-quantized'")
    for name, group in (block.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        _check(
            weights.get("group_size", MXFP4_GROUP_SIZE) == MXFP4_GROUP_SIZE and weights.get("num_bits", 4) == 4,
            f"quantization_config.config_groups.{name}.weights must be 4-bit groups of {MXFP4_GROUP_SIZE}",
        )
    return dict(block)


__all__ = ["KimiK3Config", "KimiK3TextConfig"]
