"""The shipped config `math` of `sera-jax figure math`, here by path."""

from sera_jax.harness.configs.math import get_config

__all__ = ["get_config"]
