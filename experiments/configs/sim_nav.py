"""The shipped config `sim_nav` (`--config sim_nav`), here for `--config` by path."""

from sera_jax.harness.configs.sim_nav import get_config

__all__ = ["get_config"]
