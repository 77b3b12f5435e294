"""The shipped config `math_qwen25` (`--config math_qwen25`), here for `--config` by path."""

from sera_jax.harness.configs.math_qwen25 import get_config

__all__ = ["get_config"]
