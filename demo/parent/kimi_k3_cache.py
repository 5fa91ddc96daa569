"""The generation caches of Kimi K3: one state per decoder layer, KDA recurrent states beside MLA latents.

`KimiK3Cache` grows with the sequence; `KimiK3StaticCache` is preallocated and updated in place, so that a decode
step reads and writes the same addresses every time and can be replayed from CUDA graphs (`kimi_k3_runners`). Both
are transformers `Cache`s over per-layer objects (`cache.layers[layer_idx]`, whose `update` a layer calls) and own
their token count: the model calls `advance(n)` once the layers have seen n new tokens.
"""

import dataclasses

import torch
from transformers.cache_utils import Cache

try:
    from .kimi_k3_runners import KimiK3DecodeGraph
except ImportError:  # imported from the repository root rather than as transformers remote code
    from kimi_k3_runners import KimiK3DecodeGraph


def next_positions(cache, length, device):
    """Absolute positions of `length` new tokens: right after the ones `cache` has seen (from 0 without one)."""
    past = cache.get_seq_length() if cache is not None else 0
    return torch.arange(past, past + length, device=device)


class KimiK3CacheLayer:
    """One decoder layer's share of the cache, answering what transformers' `Cache` asks of its layers (reset,
    beam reordering, batch selection, crop) over the state tensors named in `_fields` (a tuple field holds several).
    Tensors are created on the layer's own device by the layer's first call."""

    is_compileable = False
    is_sliding = False
    is_croppable = False  # a KDA state cannot be rolled back, so no layer offers it
    supports_early_init = False
    in_place = False  # whether kernels may overwrite the state tensors they are given
    _fields = ()

    def __init__(self):
        self._clear()

    def _clear(self):
        for name in self._fields:
            setattr(self, name, None)

    def tensors(self):
        """Every allocated state tensor."""
        values = [getattr(self, name) for name in self._fields]
        return [t for v in values if v is not None for t in (v if isinstance(v, tuple) else (v,))]

    def _map(self, fn):
        for name in self._fields:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, tuple(map(fn, value)) if isinstance(value, tuple) else fn(value))

    def reorder_cache(self, beam_idx):
        """Select batch rows (beam search)."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices):
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats):
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self):
        self._clear()

    def crop(self, tokens_to_remove):
        if tokens_to_remove:
            raise ValueError("The Kimi K3 cache cannot drop tokens: its KDA layers keep a recurrent state, not one "
                             "entry per token")


class KimiK3DeltaCacheLayer(KimiK3CacheLayer):
    """A KDA layer's state: the q, k and v short-conv histories and the fp32 recurrent state."""

    _fields = ("conv_states", "recurrent_state")

    def update(self, conv_states, recurrent_state):
        self.conv_states, self.recurrent_state = tuple(conv_states), recurrent_state


class KimiK3LatentCacheLayer(KimiK3CacheLayer):
    """An MLA layer's compressed latents [B, T, kv_lora_rank + qk_rope_head_dim]: `latent` is the filled front of a
    buffer with room to grow, so a decode step writes its own token where concatenation would copy every cached one
    (at 131k cached tokens that copy was 0.7 ms of a 53 ms step over 24 layers). When full, the buffer is replaced by
    one a quarter longer than needed (a copy every ~T/4 tokens: amortised O(1) a token)."""

    _fields = ("latent",)
    _buffer = None  # the storage `latent` is the front of, where it still is (a reorder or reset makes a new one)

    def update(self, latent, positions):
        """Append the new tokens' latents; returns all of this layer's keys [B, keys, width]."""
        if self.latent is None:  # a prompt's latents are kept as they come; the first step makes room
            self.latent = self._buffer = latent
            return latent
        cached, total = self.latent.shape[1], self.latent.shape[1] + latent.shape[1]
        buffer = self._buffer
        if not (buffer is not None and buffer.data_ptr() == self.latent.data_ptr()
                and buffer.stride() == self.latent.stride() and buffer.shape[1] >= total):
            buffer = self.latent.new_empty(self.latent.shape[0], total + max(64, total // 4), self.latent.shape[2])
            buffer[:, :cached] = self.latent
            self._buffer = buffer
        buffer[:, cached:total] = latent
        self.latent = buffer[:, :total]
        return self.latent


class KimiK3Cache(Cache):
    """Hybrid generation cache: transformers' `Cache` over one `KimiK3DeltaCacheLayer` per KDA layer and one
    `KimiK3LatentCacheLayer` per MLA layer, plus the count of tokens seen. Layers reach their share as
    `cache.layers[layer_idx]` and call its `update`; the decoder checks each call's mask through `prepare`."""

    delta_layer, latent_layer = KimiK3DeltaCacheLayer, KimiK3LatentCacheLayer

    def __init__(self, config):
        config = getattr(config, "text_config", config)
        super().__init__(layers=[self.delta_layer() if kind == "kda" else self.latent_layer()
                                 for kind in config.layer_types])
        self.seen_tokens = 0

    is_compileable = False
    is_croppable = False

    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def get_max_length(self, layer_idx=None):
        """Tokens the cache can hold, -1 for no limit (the name of transformers 5.x)."""
        return -1

    def get_max_cache_shape(self, layer_idx=0):
        """`get_max_length` under the name of transformers 4.57."""
        return self.get_max_length()

    @property
    def max_cache_len(self):
        return self.get_max_length()

    @property
    def batch_size(self):
        """Rows of the cached states, -1 before the first call."""
        return next((t.shape[0] for layer in self.layers for t in layer.tensors()), -1)

    @property
    def max_batch_size(self):
        """`batch_size` under the name of transformers 4.57."""
        return self.batch_size

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self.seen_tokens + query_length, 0

    def reset(self):
        super().reset()
        self.seen_tokens = 0

    def advance(self, tokens):
        """Count `tokens` new tokens as seen: called once their states are in every layer."""
        self.seen_tokens += tokens

    def prepare(self, attention_mask, batch, length, device):
        """Check a call's mask and return (mask over every key, absolute positions [length] of the new tokens)."""
        check_mask(attention_mask, self.seen_tokens + length)
        return attention_mask, next_positions(self, length, device)

    def decode_runner(self, model):
        """What runs `model`'s one-token steps on this cache in place of its forward, or None (the forward): a
        growing cache has none."""
        return None


def check_mask(attention_mask, expected):
    """A call's mask must cover the cached and the new tokens."""
    if attention_mask is not None and attention_mask.shape[-1] != expected:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} tokens, expected cached + new = {expected}")


class KimiK3StaticCacheLayer(KimiK3CacheLayer):
    """A layer's state in buffers that keep their addresses: the first call allocates them, later calls, beam
    reordering and `reset` write into them."""

    in_place = True

    def __init__(self, rows, max_length):
        super().__init__()
        self.rows, self.max_length = rows, max_length

    def reorder_cache(self, beam_idx):
        for t in self.tensors():
            t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        raise ValueError("A KimiK3StaticCache keeps its batch size; make one for the expanded batch")

    def reset(self):
        """Zeroed states are what a first call starts from."""
        for t in self.tensors():
            t.zero_()


class KimiK3StaticDeltaCacheLayer(KimiK3StaticCacheLayer, KimiK3DeltaCacheLayer):
    def update(self, conv_states, recurrent_state):
        if self.recurrent_state is None:
            super().update(tuple(c.clone() for c in conv_states), recurrent_state.clone())
            return
        for buffer, new in zip(self.conv_states + (self.recurrent_state,), tuple(conv_states) + (recurrent_state,)):
            if new is not buffer:  # fla's decode kernel and the fused short conv already wrote into their buffers
                buffer.copy_(new)


class KimiK3StaticLatentCacheLayer(KimiK3StaticCacheLayer, KimiK3LatentCacheLayer):
    def update(self, latent, positions):
        """Write the new latents at their positions; returns the whole [B, max_length, width] buffer (the unused
        tail is masked as future keys)."""
        if self.latent is None:
            self.latent = latent.new_zeros(self.rows, self.max_length, latent.shape[-1])
        return self.latent.index_copy_(1, positions, latent)


class KimiK3StaticCache(KimiK3Cache):
    """Preallocated cache for up to `max_length` tokens of `batch_size` rows, updated in place, so that a decode
    step reads and writes the same addresses every time and can be replayed as a CUDA graph.

    The attention mask and the position counter live in device buffers too. With `cuda_graph=True` and the
    `cuda_graphs` fast path on, `KimiK3ForCausalLM` replays each one-token step from CUDA graphs, one per run of
    layers on one GPU (`KimiK3DecodeGraph`). Each layer's buffers are allocated on that layer's device by its first
    call. Pass it to `generate(..., cache=cache)`; `reset()` readies it, graph and all, for the
    next prompt (as transformers' StaticCache.reset).
    """

    def __init__(self, config, batch_size, max_length, cuda_graph=True):
        self.rows, self.max_length, self.cuda_graph = batch_size, max_length, cuda_graph
        super().__init__(config)
        self.mask = None  # [B, max_length] bool: 1 = a real token
        self.position = None  # long scalar: tokens cached before the current call
        self.decode_graph = None  # a KimiK3DecodeGraph, made by the model's first one-token step with graphs on

    @staticmethod
    def layer_bytes(config, batch_size, max_length, dtype=torch.bfloat16):
        """Bytes each decoder layer's share takes, for planning a `device_map` (the cache of a layer lives on that
        layer's device): a KDA layer's q/k/v conv histories (activation dtype) and fp32 recurrent state, whatever
        the length; an MLA layer's latents for `max_length` tokens."""
        config = getattr(config, "text_config", config)
        lac, item = config.linear_attn_config, torch.finfo(dtype).bits // 8
        width = lac["num_heads"] * lac["head_dim"]
        kda = batch_size * (3 * width * (lac["short_conv_kernel_size"] - 1) * item
                            + lac["num_heads"] * lac["head_dim"] ** 2 * 4)
        mla = batch_size * max_length * (config.kv_lora_rank + config.qk_rope_head_dim) * item
        return [kda if kind == "kda" else mla for kind in config.layer_types]

    def delta_layer(self):
        return KimiK3StaticDeltaCacheLayer(self.rows, self.max_length)

    def latent_layer(self):
        return KimiK3StaticLatentCacheLayer(self.rows, self.max_length)

    def get_max_length(self, layer_idx=None):
        return self.max_length

    @property
    def batch_size(self):
        return self.rows

    def prepare(self, attention_mask, batch, length, device):
        end = self.seen_tokens + length
        if end > self.max_length:
            raise ValueError(f"KimiK3StaticCache holds {self.max_length} tokens; this call needs {end}")
        check_mask(attention_mask, end)
        if batch != self.rows:
            raise ValueError(f"KimiK3StaticCache is for batch {self.rows}, this call has {batch} rows")
        if self.mask is None:
            self.mask = torch.ones(self.rows, self.max_length, dtype=torch.bool, device=device)
            self.position = torch.zeros((), dtype=torch.long, device=device)
        self._write_inputs(attention_mask, end)
        return self.mask, self.position + torch.arange(length, device=device)

    def _write_inputs(self, attention_mask, end):
        self.position.fill_(self.seen_tokens)
        if attention_mask is None:
            self.mask[:, :end] = True
        else:
            self.mask[:, :end].copy_(attention_mask)

    def reorder_cache(self, beam_idx):
        """Select batch rows (beam search), in place."""
        super().reorder_cache(beam_idx)
        if self.mask is not None:
            self.mask.copy_(self.mask.index_select(0, beam_idx.to(self.mask.device)))

    def decode_runner(self, model):
        """The `KimiK3DecodeGraph` of `model` on this cache (made by the first step that asks, kept across `reset`),
        where `cuda_graph` is set and the `cuda_graphs` path is on for some of the model's devices; else None."""
        if not self.cuda_graph:
            return None
        if self.decode_graph is None or self.decode_graph.model is not model:
            self.decode_graph = KimiK3DecodeGraph(model)
        return self.decode_graph if self.decode_graph.enabled else None


def given_cache(cache, past_key_values, kwargs):
    """The cache a call was given: transformers passes it as `cache` from 5.24 and as `past_key_values` before, and
    a user may write either. A cache under any other keyword is an error rather than a call that silently runs
    uncached, as is a cache of another type (the hybrid KDA/MLA state needs a `KimiK3Cache`)."""
    if past_key_values is not None:
        if cache is not None and cache is not past_key_values:
            raise ValueError("Got both `cache` and `past_key_values`; pass the cache once")
        cache = past_key_values
    stray = sorted(name for name, value in kwargs.items() if isinstance(value, Cache))
    if stray:
        raise TypeError(f"Got a cache as {stray}: pass it as `cache` (or `past_key_values`)")
    if cache is not None and not isinstance(cache, KimiK3Cache):
        raise TypeError(f"Kimi K3 needs a KimiK3Cache (KDA states beside MLA latents), got {type(cache).__name__}; "
                        "leave the cache to the model or use `make_static_cache`")
    return cache


def output_with_cache(output_class, cache, **fields):
    """`output_class(**fields)` with the cache under the field name the installed transformers gives it (`cache` from
    5.24, `past_key_values` before), so that `generate` reads it back and nothing warns."""
    names = {f.name for f in dataclasses.fields(output_class)}
    return output_class(**fields, **{"cache" if "cache" in names else "past_key_values": cache})
