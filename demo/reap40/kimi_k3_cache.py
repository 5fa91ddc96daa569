"""The generation caches of Kimi K3: one state per decoder layer, KDA recurrent states beside MLA latents.

`KimiK3Cache` grows with the sequence; `KimiK3StaticCache` is preallocated and updated in place, so that a decode
step reads and writes the same addresses every time and can be replayed from CUDA graphs (`kimi_k3_runners`). Both
are transformers `Cache`s over per-layer objects (`cache.layers[layer_idx]`, whose `update` a layer calls) and own
their token count: the model calls `advance(n)` once the layers have seen n new tokens.

Both can roll back (`crop`), which assisted generation and prompt lookup need after rejected draft tokens. An MLA
layer keeps one latent a token and just forgets the tail. A KDA layer keeps one recurrent state, so once recording is
on (`activate_past_recording`, which `generate` calls for assisted modes) it keeps the state from before its most
recent tokens (at most `rollback_window` of them, since the last crop) with their delta-rule inputs and conv inputs;
`crop` replays the delta rule over the tokens it keeps from that state (the kernel the forward used), only where
something was rejected. Chosen against keeping the state at every position of a verification step by measurement
(`python -m bench.speculative rollback`, bench/results/speculative_rollback_cpu.json, CPU, fastest of 15): at the
release's KDA head shape (96 x 128) a k = 4 step plus the replay costs 1.9x the plain step where keeping every
state costs 5.2x (k = 1..8: 1.3-2.8x against 1.2-15x); at the demo's 4 x 64 the two are within 0.1 ms (~2x).
Replay also holds one state, not k + 1, and needs no kernel change: fla's kernels return final states only.
"""

import dataclasses

import torch
import transformers
from transformers.cache_utils import Cache

# How far back a recording cache can roll by default: more than any draft transformers makes by default (10 tokens
# for prompt lookup, 20 for an assistant model); `generate` raises it to a larger draft size it is given.
DEFAULT_ROLLBACK_WINDOW = 64

# `crop(0)` means "down to 0 tokens" under transformers 4.x (`crop(max_length)`) and "remove 0 tokens" under 5.x
# (which takes only `crop(-n)`); every other value means the same under both.
_CROP_ZERO_EMPTIES = int(transformers.__version__.split(".")[0]) < 5

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
    is_croppable = True
    supports_early_init = False
    in_place = False  # whether kernels may overwrite the state tensors they are given
    _fields = ()
    rollback_window = 0  # tokens `crop` may remove (0: none, nothing recorded); set by the cache

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
        self.forget_history()
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices):
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats):
        self.forget_history()
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self):
        self.forget_history()
        self._clear()

    def forget_history(self):
        """Drop what was recorded for a rollback: the tokens seen so far are final."""

    def check_crop(self, tokens):
        """Raise unless `crop(tokens)` can roll this layer back (checked on every layer before any is cropped)."""

    def crop(self, tokens):
        """Forget the last `tokens` tokens (a count >= 0; `KimiK3Cache.crop` takes transformers' conventions)."""


class KimiK3DeltaCacheLayer(KimiK3CacheLayer):
    """A KDA layer's state: the q, k and v short-conv histories and the fp32 recurrent state.

    While recording (`rollback_window` > 0) it also keeps, for the `pending` tokens seen since the last crop (at most
    the window's worth): the recurrent state before them (`base_state`), their delta-rule inputs (q, k, v, g_raw,
    beta_raw after the convs) and the conv inputs that end with them (the kernel - 1 before included), and `replay`,
    the layer's delta rule over such inputs from a state. The KDA block feeds them in (`stage_conv`, `record`)."""

    _fields = ("conv_states", "recurrent_state")
    base_state = pending = conv_inputs = replay = staged_conv = None

    def update(self, conv_states, recurrent_state):
        self.conv_states, self.recurrent_state = tuple(conv_states), recurrent_state

    def forget_history(self):
        self.base_state = self.pending = self.conv_inputs = self.replay = self.staged_conv = None

    def recorded(self, length):
        """How many of a call's `length` tokens to record: the last ones, up to the window (0 when not recording)."""
        return min(length, self.rollback_window)

    def decode_step(self, length):
        """Whether a call of `length` tokens is a decode step, which the KDA block may run as one kernel: one token
        onto the states held here, nothing recorded (recording keeps the convolved inputs and the state before the
        token, which a kernel writing the states over in place does not give)."""
        return length == 1 and self.recurrent_state is not None and not self.recorded(length)

    def stage_conv(self, projected, kernel):
        """Before the short convs run: the conv inputs of this call's recorded tokens with the kernel - 1 before
        them ([B, D, kernel - 1 + kept] per q, k, v), from `projected` [B, T, D] and the conv histories."""
        tail = kernel - 1 + self.recorded(projected[0].shape[1])
        past = self.conv_states or tuple(x.new_zeros(x.shape[0], x.shape[-1], kernel - 1) for x in projected)
        self.staged_conv = tuple(torch.cat([h.to(x.dtype), x[:, -tail:].transpose(1, 2)], dim=-1)[..., -tail:]
                                 for h, x in zip(past, projected))

    def record(self, inputs, base, replay):
        """After the delta rule ran (before `update`): `inputs` (q, k, v, g_raw, beta_raw [B, T, ...]) of the call,
        `base` the state before its recorded tokens (None: zeros), `replay(*inputs, initial_state)` -> (o, state)."""
        length = inputs[0].shape[1]
        kept = self.recorded(length)
        if kept < length:  # a copy of the tail: a view would keep a whole prompt's activations alive
            inputs = tuple(t[:, length - kept :].clone() for t in inputs)
        kernel = self.staged_conv[0].shape[-1] - kept + 1
        if self.pending is None or kept == self.rollback_window:  # `base` is the state before the whole window
            self.base_state = None if base is None else (base.clone() if self.in_place else base)
            self.pending, self.conv_inputs = inputs, self.staged_conv
        else:  # more tokens since the last crop
            self.pending = tuple(torch.cat(pair, dim=1) for pair in zip(self.pending, inputs))
            self.conv_inputs = tuple(torch.cat([old, new[..., kernel - 1 :]], dim=-1)
                                     for old, new in zip(self.conv_inputs, self.staged_conv))
        self.replay, self.staged_conv = replay, None
        excess = self.pending[0].shape[1] - self.rollback_window
        if excess > 0:  # the oldest tokens become final: the base moves past them
            self.base_state = self._state_after(excess)
            self.pending = tuple(t[:, excess:] for t in self.pending)
            self.conv_inputs = tuple(c[..., excess:] for c in self.conv_inputs)

    def _state_after(self, tokens):
        """The recurrent state after the first `tokens` pending tokens, replayed from the base state."""
        if tokens == 0:
            return self.base_state if self.base_state is not None else torch.zeros_like(self.recurrent_state)
        return self.replay(*(t[:, :tokens] for t in self.pending), initial_state=self.base_state)[1]

    def check_crop(self, tokens):
        pending = 0 if self.pending is None else self.pending[0].shape[1]
        if tokens > pending:
            raise ValueError(f"The Kimi K3 cache can roll back {pending} tokens here, not {tokens}: its KDA layers "
                             f"record the last {self.rollback_window} tokens since the previous crop (the rollback "
                             "window; raise it with cache.activate_past_recording(recurrent_states_to_keep=N))")

    def crop(self, tokens):
        if tokens == 0:
            self.forget_history()
            return
        self.check_crop(tokens)
        pending = self.pending[0].shape[1]
        kept = pending - tokens
        kernel = self.conv_inputs[0].shape[-1] - pending + 1
        state = self._state_after(kept)
        self.set_state(tuple(c[..., kept : kept + kernel - 1] for c in self.conv_inputs), state)
        self.forget_history()

    def set_state(self, conv_states, recurrent_state):
        """Replace the states (a rollback)."""
        self.update(tuple(c.clone() for c in conv_states), recurrent_state)


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

    def buffer_for(self, latent):
        """The buffer the new tokens' latents are to be written into in place at their positions (a static cache's),
        or None: they go through `update`."""
        return None

    def crop(self, tokens):
        """Forget the last `tokens` latents (the buffer keeps its room: the next update writes over them)."""
        if tokens and self.latent is not None:
            self.latent = self.latent[:, : self.latent.shape[1] - tokens]


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
    is_croppable = True
    rollback_window = 0  # see `activate_past_recording`

    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def activate_past_recording(self, recurrent_states_to_keep=None, **kwargs):
        """Record what `crop` needs to roll back up to max(`recurrent_states_to_keep`, DEFAULT_ROLLBACK_WINDOW)
        tokens since the previous crop (transformers 5.x calls this before assisted decoding; `generate` here calls
        it for assisted modes on every transformers line). Recording stays on for this cache."""
        self.rollback_window = max(self.rollback_window, recurrent_states_to_keep or 0, DEFAULT_ROLLBACK_WINDOW)
        for layer in self.layers:
            layer.rollback_window = self.rollback_window

    def get_recurrent_states_to_keep(self, layer_idx=None):
        """The rollback window, under the name transformers 5.x asks for it."""
        return self.rollback_window

    def crop(self, max_length):
        """Roll back to `max_length` tokens, or by `-max_length` tokens where negative (transformers' conventions;
        `crop(0)` is "to 0 tokens" under 4.x, "by 0 tokens" under 5.x). Also ends the current rollback span: what
        is kept is final. A KDA layer rolls back at most what it recorded (see `activate_past_recording`)."""
        if max_length < 0 or (max_length == 0 and not _CROP_ZERO_EMPTIES):
            tokens = -max_length
        else:
            tokens = max(self.seen_tokens - max_length, 0)
        if tokens > self.seen_tokens:
            raise ValueError(f"Cannot crop {tokens} tokens from a cache of {self.seen_tokens}")
        for layer in self.layers:
            layer.check_crop(tokens)
        for layer in self.layers:
            layer.crop(tokens)
        self.seen_tokens -= tokens

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
        self.forget_history()
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

    def set_state(self, conv_states, recurrent_state):
        self.update(conv_states, recurrent_state)  # copied into the buffers, which keep their addresses


class KimiK3StaticLatentCacheLayer(KimiK3StaticCacheLayer, KimiK3LatentCacheLayer):
    def update(self, latent, positions):
        """Write the new latents at their positions; returns the whole [B, max_length, width] buffer (the unused
        tail is masked as future keys)."""
        return self.buffer_for(latent).index_copy_(1, positions, latent)

    def buffer_for(self, latent):
        """The [B, max_length, width] buffer (made by the first call, zeroed), written in place."""
        if self.latent is None:
            self.latent = latent.new_zeros(self.rows, self.max_length, latent.shape[-1])
        return self.latent

    def crop(self, tokens):
        """Nothing to drop: slots past the cache's token count are future keys, masked, and written over next."""


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
        where `cuda_graph` is set and the `cuda_graphs` path is on for some of the model's devices; else None. A
        recording cache (assisted generation) runs its one-token steps eagerly: they record for a rollback."""
        if not self.cuda_graph or self.rollback_window:
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


def generation_cache_key():
    """The keyword `generate` keeps the cache under in its model kwargs: `cache` from transformers 5.24,
    `past_key_values` before (the field name of its outputs)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def output_with_cache(output_class, cache, **fields):
    """`output_class(**fields)` with the cache under the field name the installed transformers gives it (`cache` from
    5.24, `past_key_values` before), so that `generate` reads it back and nothing warns."""
    names = {f.name for f in dataclasses.fields(output_class)}
    return output_class(**fields, **{"cache" if "cache" in names else "past_key_values": cache})
