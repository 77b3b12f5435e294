"""The shipped config `maze17` (`--config maze17`), here for `--config` by path."""

from sera_jax.harness.configs.maze17 import get_config

__all__ = ["get_config"]
