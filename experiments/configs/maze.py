"""The shipped config `maze` (`--config maze`), here for `--config` by path."""

from sera_jax.harness.configs.maze import get_config

__all__ = ["get_config"]
