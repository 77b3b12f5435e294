"""The shipped config `gsm8k_smollm2` (`--config gsm8k_smollm2`), here for `--config` by path."""

from sera_jax.harness.configs.gsm8k_smollm2 import get_config

__all__ = ["get_config"]
