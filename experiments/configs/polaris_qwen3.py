"""The shipped config `polaris_qwen3` (`--config polaris_qwen3`), here for `--config` by path."""

from sera_jax.harness.configs.polaris_qwen3 import get_config

__all__ = ["get_config"]
