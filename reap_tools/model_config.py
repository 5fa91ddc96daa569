"""The model's own validation of a checkpoint's config.json, for tools that read the file as plain JSON.

verify, upload, prune and plan would otherwise accept configs the model refuses at load time (top-k 0 or above the
expert count, counts written as strings); `KimiK3Config` is the one place those rules live, so they run it.
"""

from __future__ import annotations

from configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig

from .checkpoint import CONFIG_NAME, CheckpointError


def model_text_config(config: dict, where: str = CONFIG_NAME) -> KimiK3TextConfig:
    """The text config the model builds from `config` (a parsed config.json); CheckpointError where it refuses it."""
    try:
        return KimiK3Config(**config).text_config
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: the model refuses this config: {e}") from None
