"""The shipped config `default` (`--config default`), here for `--config` by path."""

from sera_jax.harness.configs.default import get_config

__all__ = ["get_config"]
