"""Test setup: no network, the repository root importable, and small shared fixtures."""

import os

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

