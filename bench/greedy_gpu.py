"""Which fast path moves greedy decoding away from the reference: the teacher-forced check of
tests/test_gpu_paths.py (64 greedy steps of `bench.common.small_model`, bf16) with one fast path on at a time, then
all.

Prints, per combination, the share of steps where the reference's argmax is the fast run's token and the mean and
largest shortfall in logit standard deviations. CUDA only: `python -m bench.greedy_gpu`.
"""

import sys

import torch

from bench import common
from bench.common import small_model, teacher_forced
from kimi_k3_dispatch import use_fast_paths

COMBINATIONS = {  # Triton experts, fla decode, fla prefill
    "reference": (False, False, False),
    "triton experts": (True, False, False),
    "fla decode": (False, True, False),
    "fla prefill": (False, False, True),
    "defaults": (True, True, False),
    "all": (True, True, True),
}


def main():
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    common.quick_tune_from_env()
    model = small_model()
    prompt = torch.tensor([[11, 200, 37, 5, 91, 14, 3, 77, 123, 42]], device="cuda")
    for name, (experts, decode, prefill) in COMBINATIONS.items():
        with torch.no_grad(), use_fast_paths(model, experts=experts, kda=decode, kda_prefill=prefill):
            fast = model.generate(prompt, max_new_tokens=64, do_sample=False)
        agree, mean_gap, max_gap = teacher_forced(model, prompt, fast)  # switches everything off itself
        print(f"{name:15s}: argmax agreement {agree:5.0%}, mean gap {mean_gap:.4f}, largest {max_gap:.3f} logit std",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
