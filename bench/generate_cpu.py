"""Greedy-generation tokens/s of a tiny model on CPU: our Kimi K3 remote code vs transformers' native `kimi_linear`.

Same process, same prompt, same width / depth / expert count / top-k / shared experts / KDA and MLA head shapes, both
fp32 with random weights; only the architectures' own differences remain (K3: Block Attention Residuals, LatentMoE
with its down/up projections and norm, SiTU, KDA lower-bound gate, gated NoPE MLA; our routed experts MXFP4 and
dequantized per call, or plain fp32 with --bf16-experts' counterpart row). Prints tokens/s for each and the ratio
ours / native. Needs transformers 5.x (which has `kimi_linear`); run with fla-core absent, since transformers would
hand native KDA to fla's GPU kernels.

    python -m bench.generate_cpu [--new-tokens 64] [--prompt 32] [--rounds 3] [--threads N] [--json out.json]
"""

import argparse
import os
import sys
import time

import torch

from bench import common
from reap_tools.tiny import random_model, tiny_config

SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_experts=16,
             num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=128, num_attention_heads=4,
             q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             kda_heads=4, kda_head_dim=64, full_attn_layers=[3, 6], kda_layers=[1, 2, 4, 5])


def ours(packed):
    s = SHAPE
    config = tiny_config(
        packed=packed, vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_hidden_layers"],
        num_experts=s["num_experts"], num_experts_per_token=s["num_experts_per_token"],
        num_shared_experts=s["num_shared_experts"], moe_intermediate_size=s["moe_intermediate_size"],
        routed_expert_hidden_size=s["hidden_size"],  # same expert FLOPs per token as the native (no latent)
        num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_attention_heads"],
        q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"], v_head_dim=s["v_head_dim"], attn_res_block_size=3,
        linear_attn_config=dict(num_heads=s["kda_heads"], head_dim=s["kda_head_dim"],
                                full_attn_layers=s["full_attn_layers"], kda_layers=s["kda_layers"]),
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return random_model(config, seed=0)


def native():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    s = SHAPE
    config = KimiLinearConfig(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        moe_intermediate_size=s["moe_intermediate_size"], num_hidden_layers=s["num_hidden_layers"],
        num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_attention_heads"],
        n_shared_experts=s["num_shared_experts"], kv_lora_rank=s["kv_lora_rank"], q_lora_rank=s["q_lora_rank"],
        qk_rope_head_dim=s["qk_rope_head_dim"], v_head_dim=s["v_head_dim"], qk_nope_head_dim=s["qk_nope_head_dim"],
        num_experts_per_tok=s["num_experts_per_token"], num_local_experts=s["num_experts"],
        linear_attn_config=dict(full_attn_layers=s["full_attn_layers"], kda_layers=s["kda_layers"],
                                head_dim=s["kda_head_dim"], num_heads=s["kda_heads"], short_conv_kernel_size=4),
        first_k_dense_replace=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    return KimiLinearForCausalLM(config).eval()


def generate_s(model, prompt, new_tokens):
    """Seconds for one greedy generation of exactly `new_tokens` tokens."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(prompt, do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
        seconds = time.perf_counter() - start
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import transformers

    if not hasattr(transformers, "KimiLinearForCausalLM"):
        print("transformers has no kimi_linear here (it needs 5.x)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = torch.randint(3, SHAPE["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(0))
    results = {"shape": SHAPE, "prompt_tokens": args.prompt, "new_tokens": args.new_tokens,
               "threads": torch.get_num_threads(), "transformers": transformers.__version__, "tok_s": {},
               "load_average_at_start": os.getloadavg()}  # a busy shared CPU makes these numbers noisy
    models = {"native kimi_linear": native(), "ours (MXFP4 experts)": ours(packed=True),
              "ours (fp32 experts)": ours(packed=False)}
    for model in models.values():
        generate_s(model, prompt, 2)  # warm-up
    best = {name: float("inf") for name in models}
    for _ in range(args.rounds):  # interleaved, best of `rounds`: a busy shared CPU drifts during the run
        for name, model in models.items():
            best[name] = min(best[name], generate_s(model, prompt, args.new_tokens))
    for name, model in models.items():
        results["tok_s"][name] = args.new_tokens / best[name]
        params = sum(p.numel() for p in model.parameters())
        print(f"{name:24s} {results['tok_s'][name]:8.1f} tok/s   ({params / 1e6:.1f}M parameters)", flush=True)
    base = results["tok_s"]["native kimi_linear"]
    for name in models:
        if name.startswith("ours"):
            results[f"ratio {name} / native"] = results["tok_s"][name] / base
            print(f"ratio {name} / native: {results['tok_s'][name] / base:.2f}")
    results["load_average_at_end"] = os.getloadavg()
    if args.json:
        common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
