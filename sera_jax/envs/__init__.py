"""Environments with binary rewards, in pure JAX."""

from sera_jax.envs import maze

__all__ = ["maze"]
