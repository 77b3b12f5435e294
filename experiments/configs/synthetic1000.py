"""The shipped config `synthetic1000` (`--config synthetic1000`), here for `--config` by path."""

from sera_jax.harness.configs.synthetic1000 import get_config

__all__ = ["get_config"]
