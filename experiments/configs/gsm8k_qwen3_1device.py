"""The shipped config `gsm8k_qwen3_1device`, here for `--config` by path."""

from sera_jax.harness.configs.gsm8k_qwen3_1device import get_config

__all__ = ["get_config"]
