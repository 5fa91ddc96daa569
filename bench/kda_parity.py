"""KDA prefill at the release width (96 heads x 128): each CUDA path's output and final state against a float64
recomputation, and what the state's error does to the decode steps after it; plus each path's prefill time.

Why: with fla's chunked prefill kernel the small GPU test model's greedy tokens stray from the reference much more
than with fla's decode kernel, although each call stays within bf16 rounding of the output. This measures whether
the difference is in the output or in the state the prefill leaves for decoding, on the same inputs:

  * torch: the model's reference (`kda.kda_forward(kernel=None)`: fp32 WY chunks of 64 tokens);
  * fla_chunk / fla_chunk_no_safe_gate: fla-core's `chunk_kda` (the `kda_prefill` path), safe gate on / off;
  * fla_recurrent: fla-core's fused recurrent kernel (the `kda` path) run over all the prompt's tokens.

Inputs are random at the release's shapes and gate (`gate_lower_bound` -5): q, k, v, the raw gate and beta in bf16,
A_log for decay rates 1..16, dt_bias small. The float64 truth runs `kda.chunk_kda` in float64 on the same inputs
(gate, l2norm and sigmoid recomputed in float64). After the prompt, 32 decode steps of new random tokens run with
fla's recurrent kernel from each path's state, against float64 decode steps from the true state.

    python -m bench.kda_parity --out bench/results/kda_parity_h200.json
"""

import argparse
import os
import statistics

import torch

import kda
from bench import common

HEADS, DIM, LOWER_BOUND = 96, 128, -5.0
DECODE_STEPS = 32
PATHS = {
    "torch": dict(kernel=None),
    "fla_chunk": dict(kernel="chunk", safe_gate=True),
    "fla_chunk_no_safe_gate": dict(kernel="chunk", safe_gate=False),
    "fla_recurrent": dict(kernel="recurrent"),
}


def inputs(length, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * std).bfloat16()

    shape = (1, length, HEADS, DIM)
    return dict(q=randn(*shape), k=randn(*shape), v=randn(*shape), g_raw=randn(*shape),
                beta_raw=randn(1, length, HEADS))


def weights(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    A_log = torch.empty(HEADS, device="cuda").uniform_(0.0, 2.77, generator=gen)  # exp: decay rates 1..16
    dt_bias = torch.randn(HEADS * DIM, generator=gen, device="cuda") * 0.1
    return A_log, dt_bias


def truth(x, A_log, dt_bias, state=None):
    """float64 KDA of the bf16 inputs `x` (gate, l2norm and beta sigmoid in float64 too)."""
    d = {k: v.double() for k, v in x.items()}
    g = LOWER_BOUND * torch.sigmoid(A_log.double().exp().view(HEADS, 1) * (d["g_raw"] + dt_bias.double().view(HEADS, DIM)))
    q, k = kda.l2norm(d["q"]), kda.l2norm(d["k"])
    args = (q, k, d["v"], g, torch.sigmoid(d["beta_raw"]))
    if x["q"].shape[1] == 1:
        return kda.recurrent_kda(*args, scale=DIM**-0.5, initial_state=state)
    return kda.chunk_kda(*args, scale=DIM**-0.5, initial_state=state, chunk_size=64)


def run(path, x, A_log, dt_bias, state=None):
    options = dict(PATHS[path])
    return kda.kda_forward(x["q"], x["k"], x["v"], x["g_raw"], x["beta_raw"], A_log, dt_bias, LOWER_BOUND,
                           DIM**-0.5, state, **options)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def measure(length, seed=0):
    x, (A_log, dt_bias) = inputs(length, seed), weights(seed)
    true_o, true_state = truth(x, A_log, dt_bias)
    steps = [inputs(1, seed + 1 + i) for i in range(DECODE_STEPS)]
    true_decode, state = [], true_state
    for step in steps:
        o, state = truth(step, A_log, dt_bias, state)
        true_decode.append(o)
    row = {"bf16_rounding_of_true_o": rel(true_o.bfloat16(), true_o)}
    for path in PATHS:
        o, prefill_state = run(path, x, A_log, dt_bias)
        decode_errors, state = [], prefill_state
        for step, want in zip(steps, true_decode):
            got, state = kda.kda_forward(step["q"], step["k"], step["v"], step["g_raw"], step["beta_raw"], A_log,
                                         dt_bias, LOWER_BOUND, DIM**-0.5, state.float().clone(),
                                         kernel="recurrent")
            decode_errors.append(rel(got, want))
        row[path] = {"o_rel_err": rel(o, true_o), "state_rel_err": rel(prefill_state, true_state),
                     "decode_o_rel_err_first_last_mean": [decode_errors[0], decode_errors[-1],
                                                          statistics.mean(decode_errors)],
                     "ms": common.time_ms(lambda: run(path, x, A_log, dt_bias), reps=5)}
        print(f"T={length:6d} {path:24s} o {row[path]['o_rel_err']:.2e}  state {row[path]['state_rel_err']:.2e}  "
              f"decode after it {statistics.mean(decode_errors):.2e}  {row[path]['ms']:.2f} ms", flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 74, 2048, 8192])
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "kda_parity_h200.json"))
    args = parser.parse_args()
    common.quick_tune_from_env()
    result = {"device": torch.cuda.get_device_name(), "heads": HEADS, "head_dim": DIM, "lower_bound": LOWER_BOUND,
              "decode_steps_after": DECODE_STEPS, "by_length": {}}
    for length in args.lengths:
        result["by_length"][str(length)] = measure(length)
        common.write_json(args.out, result)


if __name__ == "__main__":
    main()
