"""Test setup: no network, the repository root importable, and small shared fixtures."""

import importlib.util
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def packed_checkpoint(tmp_path):
    """A tiny random checkpoint with MXFP4 experts, in the release layout."""
    from reap_tools.tiny import write_checkpoint

    return write_checkpoint(str(tmp_path / "tiny-mxfp4"), packed=True, seed=0)


@pytest.fixture(scope="session")
def bench():
    """`bench(name)` imports the script bench/<name>.py (bench/ is a folder of scripts, not a package)."""
    def load(name):
        path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
