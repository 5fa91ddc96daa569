"""CPU defaults for the tools that run a model (generate, observe): the dtype that is faster here, and the threads.

Measured with the demo on a 2-core AVX512-BF16 CPU without AMX (README, "On the CPU"): float32 as fast as bfloat16
in one-token steps and 1.2-1.5x faster over a 512-token forward on 2 threads; on an AVX2-only CPU bfloat16 ran
2.7x slower. Only AMX tiles make bfloat16 matmuls the faster ones, so a model that runs on the CPU is
loaded in float32 unless the CPU has them. On an accelerator the checkpoint's own dtype stays.
"""

from __future__ import annotations

import sys

DTYPES = ("auto", "bfloat16", "float16", "float32")


def runs_on_cpu(device_map=None) -> bool:
    """Whether a model loaded with `device_map` (None: transformers' default, an accelerator when there is one)
    runs on the CPU."""
    import torch

    if device_map == "cpu":
        return True
    if device_map not in (None, "auto"):
        return False  # an explicit placement
    accelerator = getattr(torch, "accelerator", None)
    return not (accelerator.is_available() if accelerator is not None else torch.cuda.is_available())


def fast_bf16() -> bool:
    """Whether this CPU has AMX tiles, the only CPU feature that made bfloat16 matmuls beat float32 ones."""
    import torch

    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


def choose(prog: str, dtype: str = "auto", device_map=None, threads: int | None = None):
    """Set torch's CPU threads (None: torch's default) and return the dtype to load the model with (a torch dtype,
    or "auto" for the checkpoint's own); says both on one stderr line."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    where = "CPU" if runs_on_cpu(device_map) else "accelerator"
    if dtype != "auto":
        chosen, why = getattr(torch, dtype), "--dtype"
    elif where == "accelerator":
        chosen, why = "auto", "the checkpoint's"
    elif fast_bf16():
        chosen, why = "auto", "the checkpoint's; this CPU has AMX"
    else:
        chosen, why = torch.float32, "no AMX on this CPU: bfloat16 is no faster here"
    name = chosen if chosen == "auto" else str(chosen).removeprefix("torch.")
    print(f"{prog}: {where}, dtype {name} ({why}), {torch.get_num_threads()} CPU thread(s) (--dtype, --threads)",
          file=sys.stderr)
    return chosen
