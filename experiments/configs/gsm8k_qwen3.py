"""The shipped config `gsm8k_qwen3` (`--config gsm8k_qwen3`), here for `--config` by path."""

from sera_jax.harness.configs.gsm8k_qwen3 import get_config

__all__ = ["get_config"]
