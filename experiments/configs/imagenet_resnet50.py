"""The shipped config `imagenet_resnet50`, here for `--config` by path."""

from sera_jax.harness.configs.imagenet_resnet50 import get_config

__all__ = ["get_config"]
