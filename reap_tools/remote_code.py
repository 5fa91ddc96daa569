"""The remote-code files a checkpoint of this model carries, and how they get there.

A checkpoint folder needs the model's code (`auto_map` names it) and the tokenizer's (`tokenizer_config.json` names
it) beside its weights. The files are this package's own root modules; `prune` writes them into every checkpoint it
makes (so a pruned checkpoint runs the code that wrote it, whatever the source carried), and the demo checkpoints in
this repository hold copies of them (`sync_remote_code`; tests/test_demo.py keeps the copies byte-identical), real
files so that a copied folder, an upload and the Hub all carry the code.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# The package's root: the folder holding reap_tools/ and the root modules (a checkout, or site-packages).
ROOT = Path(__file__).resolve().parents[1]
MODEL_CODE = ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "kimi_k3_dispatch.py", "kimi_k3_cache.py",
              "kimi_k3_runners.py", "kimi_k3_loading.py", "kda.py", "mxfp4.py", "mxfp4_triton.py", "fused_triton.py",
              "tensor_parallel.py")
TOKENIZER_CODE = ("tokenization_kimi_k3.py", "kimi_k3_parsing.py")
REMOTE_CODE = MODEL_CODE + TOKENIZER_CODE
# config.json's auto_map: the classes the model's Auto* loaders take from MODEL_CODE.
AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3Config",
    "AutoModel": "modeling_kimi_k3.KimiK3Model",
    "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForCausalLM",
}


def copy_remote_code(dst: str | os.PathLike, names=REMOTE_CODE) -> list[str]:
    """Copy the package's remote-code files into `dst` (replacing files or links of those names); returns them."""
    dst = Path(dst)
    for name in names:
        target = dst / name
        if target.is_symlink():
            target.unlink()
        shutil.copyfile(ROOT / name, target)
    return list(names)


def sync_remote_code(dst: str | os.PathLike) -> list[str]:
    """Make `dst`'s remote-code files copies of the root ones (replacing links), and remove any other .py file
    there; returns the names."""
    dst = Path(dst)
    names = copy_remote_code(dst)
    for stale in dst.glob("*.py"):
        if stale.name not in REMOTE_CODE:
            stale.unlink()
    return names
