"""MXFP4 reference in pure torch: the compressed-tensors ``mxfp4-pack-quantized`` format.

Only the routed experts of Kimi K3 are MXFP4. Each ``[out, in]`` weight is stored as
``weight_packed`` (uint8 ``[out, in/2]``: element ``2j`` in the low nibble, ``2j+1`` in the high
nibble, nibble bit 3 the sign, bits 0-2 an index into the E2M1 magnitudes) and ``weight_scale``
(uint8 ``[out, in/32]``: an E8M0 exponent, one per group of 32 inputs, value ``2**(s - 127)``).

``dequantize_mxfp4`` matches ``MXFP4PackedCompressor.decompress`` bit for bit and
``quantize_mxfp4`` produces the bytes of ``MXFP4PackedCompressor.compress`` fed with the
scales of compressed-tensors' own ``calculate_qparams`` (tests/test_mxfp4.py checks both).
This module needs only torch, so remote code can import it without compressed-tensors.
"""

import functools
from collections import namedtuple

import torch

GROUP_SIZE = 32
E8M0_BIAS = 127
FORMAT = "mxfp4-pack-quantized"

# Indexed by the whole nibble: codes 8..15 are the negatives of 0..7 (code 8 is -0.0).
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)

# Both elements of every packed byte (low nibble first), and the value of every E8M0 scale code, so that
# dequantization is two table lookups and one multiply.
BYTE_TO_PAIR = torch.stack((E2M1[torch.arange(256) & 0x0F], E2M1[torch.arange(256) >> 4]), dim=-1)
E8M0_VALUES = torch.exp2(torch.arange(256, dtype=torch.float32) - E8M0_BIAS)

# Which modules are MXFP4: the routed experts' w1/w2/w3 and nothing else. A regex rather than the
# public release's ``["Linear"]``: with ``"Linear"`` transformers' compressed-tensors loader would
# also turn the MoE block's bf16 ``nn.Linear``s (routed_expert_down_proj/up_proj, the router
# gate) into packed modules, which the checkpoint does not hold.
EXPERT_TARGET = r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"

DEFAULT_IGNORE = (
    r"re:.*self_attn.*",
    r"re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    r"re:.*lm_head.*",
    r"re:.*vision_tower.*",
    r"re:.*mm_projector.*",
)

_QUANTIZABLE_DTYPES = (torch.bfloat16, torch.float32)


def _check_packs(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> None:
    """Raise ValueError unless the two tensors form a valid [out, in] MXFP4 pack."""
    for name, t in (("weight_packed", weight_packed), ("weight_scale", weight_scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8, got {t.dtype} with shape {tuple(t.shape)}")
        if t.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    out_features, half_in = weight_packed.shape
    in_features = 2 * half_in
    if in_features % GROUP_SIZE:
        raise ValueError(
            f"weight_packed shape {tuple(weight_packed.shape)} means in_features={in_features}, "
            f"which is not a multiple of {GROUP_SIZE}"
        )
    expected = (out_features, in_features // GROUP_SIZE)
    if tuple(weight_scale.shape) != expected:
        raise ValueError(
            f"weight_scale shape {tuple(weight_scale.shape)} does not match weight_packed shape "
            f"{tuple(weight_packed.shape)}: expected {expected}"
        )


def check_weight(weight: torch.Tensor, name: str = "weight") -> None:
    """Raise ValueError (naming ``name``) unless ``weight`` can be quantized to MXFP4.

    Accepted: a 2-D float32/bfloat16 tensor with in-dim a multiple of 32, all values finite and
    no group so large that its scale exponent would overflow E8M0 (|x| >= 1.75 * 2**127;
    compressed-tensors turns such groups into an infinite scale). float16 is refused because
    compressed-tensors' float16 path differs: its 2**-127 scale underflows to 0 there.
    """
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.ndim != 2:
        raise ValueError(f"{name} must be 2-D [out, in], got shape {tuple(weight.shape)}")
    if weight.dtype not in _QUANTIZABLE_DTYPES:
        raise ValueError(f"{name} must be float32 or bfloat16, got {weight.dtype}")
    if weight.shape[1] % GROUP_SIZE:
        raise ValueError(
            f"{name} has shape {tuple(weight.shape)}: in_features={weight.shape[1]} "
            f"is not a multiple of {GROUP_SIZE}"
        )
    if weight.device.type == "meta":
        raise ValueError(f"{name} is on the meta device and has no values")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{name} has non-finite values (nan or inf)")
    if weight.numel() and float(weight.abs().max()) >= 1.75 * 2.0**127:
        raise ValueError(f"{name} has |values| >= 1.75 * 2**127: the E8M0 scale would overflow")


def dequantize_mxfp4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Unpack ``weight_packed`` [out, in/2] with ``weight_scale`` [out, in/32] into [out, in].

    E2M1 value and scale are both cast to ``dtype`` and multiplied there, as compressed-tensors
    does, so the result is exact unless it overflows or underflows ``dtype`` (scale code 255 is
    2**128 = inf, so a zero nibble under it gives nan, as in the library).
    """
    _check_packs(weight_packed, weight_scale)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    return dequantize_unchecked(weight_packed, weight_scale, dtype)


def dequantize_unchecked(weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_mxfp4`` without its argument checks, for packs known valid (a model's own ``MXFP4Linear``
    parameters, whose dtype and shapes loading enforces): at a CPU decode step the checks cost a few us a call."""
    out_features, half_in = weight_packed.shape
    pairs, scales = _tables(weight_packed.device, dtype)
    codes = weight_packed.reshape(-1).int()
    if pairs.ndim == 1:
        values = pairs.index_select(0, codes).view(dtype)
    else:
        values = torch.nn.functional.embedding(codes, pairs)
    scale = scales.index_select(0, weight_scale.reshape(-1).int()).view(out_features, -1, 1)
    return values.view(out_features, -1, GROUP_SIZE).mul_(scale).view(out_features, 2 * half_in)  # values is ours


# An integer as wide as two elements of a dtype, by its element size: a byte's pair read as one integer.
_PAIR_AS_INT = {2: torch.int32, 4: torch.int64}


@functools.lru_cache(maxsize=None)
def _tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``BYTE_TO_PAIR`` and ``E8M0_VALUES`` cast to ``dtype`` on ``device``, built once per pair.

    Where ``dtype`` is 2 or 4 bytes wide the pair table is viewed as 256 integers, so that the byte lookup is
    a 1-D ``index_select`` (on CPU about twice as fast as gathering rows of pairs); otherwise it stays [256, 2].
    Casting the tables rather than the looked-up values gives the same numbers.
    """
    pairs = BYTE_TO_PAIR.to(device=device, dtype=dtype)
    if pairs.element_size() in _PAIR_AS_INT:
        pairs = pairs.view(_PAIR_AS_INT[pairs.element_size()]).reshape(256)
    return pairs, E8M0_VALUES.to(device=device).to(dtype)


def _scale_codes(weight: torch.Tensor) -> torch.Tensor:
    """E8M0 code per group of 32, as compressed-tensors' ``calculate_qparams`` picks it.

    ``e = floor(log2(amax)) + (mantissa(amax) >= 1.75)`` (the library rounds amax to a power of
    two by adding half an E2M1 mantissa step to its bits), code ``clamp(127 + e - 2, 0, 255)``; an
    all-zero group gets code 0 (log2(0) = -inf, clamped).
    """
    out_features, in_features = weight.shape
    amax = weight.abs().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE).amax(-1)
    mantissa, exponent = torch.frexp(amax.to(torch.float32))  # amax = mantissa * 2**exponent
    e = (exponent - 1) + (mantissa >= 0.875).to(exponent.dtype)  # mantissa in [0.5, 1)
    codes = torch.clamp(E8M0_BIAS + e - 2, 0, 255)
    return torch.where(amax == 0, torch.zeros_like(codes), codes).to(torch.uint8)


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Nibble per element of ``scaled`` = x / scale: round half to even onto E2M1, clamped to 6.

    Ties go to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
    5 -> 4), matching the library's thresholds. The sign bit is set iff ``scaled < 0``: a negative
    value that rounds to zero is stored as -0 (code 8), while an exact -0.0 input is stored as +0,
    because the library takes the sign with ``torch.sign``.
    """
    mag = scaled.abs()
    index = (
        (mag > 0.25).to(torch.uint8)
        + (mag >= 0.75)
        + (mag > 1.25)
        + (mag >= 1.75)
        + (mag > 2.5)
        + (mag >= 3.5)
        + (mag > 5.0)
    )
    return index | ((scaled < 0).to(torch.uint8) << 3)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float32/bfloat16 ``weight`` [out, in] to ``(weight_packed, weight_scale)``.

    Same bytes as compressed-tensors' MXFP4 compressor: per group of 32 a power-of-two scale from
    ``_scale_codes``, then each element divided by the scale in the weight's own dtype (exact for
    a power of two) and rounded by ``_e2m1_codes``. Values above 6 * scale saturate to +-6: with
    the library's 1.75 threshold a group whose amax mantissa is in (1.5, 1.75) clips its largest
    values by up to 1/7.
    """
    check_weight(weight)
    out_features, in_features = weight.shape
    codes = _scale_codes(weight)
    scale = torch.exp2(codes.to(torch.float32) - E8M0_BIAS).to(weight.dtype)
    groups = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    nibbles = _e2m1_codes(groups / scale.unsqueeze(-1)).reshape(out_features, in_features // 2, 2)
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return packed.contiguous(), codes


def mxfp4_quantization_config(ignore=None) -> dict:
    """The compressed-tensors ``quantization_config`` block of the MXFP4 Kimi K3 checkpoint.

    As the public release describes it (one weight-only MXFP4 group, bf16 everywhere
    else), except for ``targets``: see ``EXPERT_TARGET``. ``ignore`` replaces the default list
    of ignore regexes when given.
    """
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": [EXPERT_TARGET],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": GROUP_SIZE,
                    "symmetric": True,
                    "scale_dtype": "torch.uint8",
                    "dynamic": False,
                },
                "input_activations": None,
                "format": FORMAT,
            }
        },
        "ignore": list(DEFAULT_IGNORE if ignore is None else ignore),
    }


# A block's MXFP4 experts as one [E, ...] tensor per weight (w1/w3 [E, I, L/2] packs and [E, I, L/32] scales, w2
# [E, L, I/2] and [E, L, I/32]), which both the reference and the expert kernels read; `key` identifies the
# parameters it was made from, `max_scale_code` is the largest E8M0 code (kernels pick their upcast by it).
ExpertStack = namedtuple("ExpertStack", "w1 s1 w3 s3 w2 s2 latent inner key max_scale_code")


def max_scale_code(*scales):
    """The largest E8M0 code among `scales` (one host read)."""
    return max(int(s.max()) for s in scales)


def stack_experts(experts):
    """The `ExpertStack` of `experts` (a block's `KimiK3Experts`): its stacked parameters, not copies; its `key` is
    for the owner to set."""
    w1, w3, w2 = experts.w1, experts.w3, experts.w2
    stacks = dict(w1=w1.weight_packed, s1=w1.weight_scale, w3=w3.weight_packed, s3=w3.weight_scale,
                  w2=w2.weight_packed, s2=w2.weight_scale)
    return ExpertStack(**stacks, latent=w1.in_features, inner=w1.out_features, key=None,
                       max_scale_code=max_scale_code(stacks["s1"], stacks["s3"], stacks["s2"]))
