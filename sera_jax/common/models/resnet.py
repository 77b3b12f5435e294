"""ResNet-18 / ResNet-50 (He et al. 2016, v1.5 strides) in Flax NNX with BatchNorm.

The ImageNet protocol of docs/method.md#classification-as-rl trains ResNet-50 from scratch on
224x224 crops with the standard stem (7x7/2 convolution + 3x3/2 max-pool). For 8x8 and 32x32
images on a CPU, `small_inputs=True` swaps in a 3x3/1 stem without the max-pool, and `width`
scales all channel counts down.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sera_jax.common.models import conv

# He-normal on fan-out, the usual initialisation for ReLU convolution stacks.
_conv_init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


def _conv(fan_in: int, fan_out: int, kernel: int, stride: int, dtype, rngs: nnx.Rngs) -> nnx.Conv:
  # Symmetric padding k // 2 (as in the reference implementation), not 'SAME',
  # which pads asymmetrically at stride 2.
  pad = kernel // 2
  return nnx.Conv(fan_in, fan_out, (kernel, kernel), strides=stride,
                  padding=((pad, pad), (pad, pad)), use_bias=False,
                  kernel_init=_conv_init, dtype=dtype,
                  conv_general_dilated=conv.conv_general_dilated, rngs=rngs)


def _norm(features: int, dtype, rngs: nnx.Rngs, *, zero_scale: bool = False) -> nnx.BatchNorm:
  scale_init = nnx.initializers.zeros if zero_scale else nnx.initializers.ones
  return nnx.BatchNorm(features, momentum=0.9, epsilon=1e-5, scale_init=scale_init,
                       dtype=dtype, rngs=rngs)


class _ResidualBlock(nnx.Module):
  """The shortcut shared by both blocks: identity, or a 1x1 projection when shapes change."""

  def _init_shortcut(self, fan_in: int, fan_out: int, stride: int, dtype, rngs: nnx.Rngs):
    self.has_projection = stride != 1 or fan_in != fan_out
    if self.has_projection:
      self.proj_conv = _conv(fan_in, fan_out, 1, stride, dtype, rngs)
      self.proj_bn = _norm(fan_out, dtype, rngs)

  def _add_shortcut(self, x: jax.Array, y: jax.Array, train: bool) -> jax.Array:
    if self.has_projection:
      x = self.proj_bn(self.proj_conv(x), use_running_average=not train)
    return nnx.relu(x + y)


class BasicBlock(_ResidualBlock):
  """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

  expansion = 1

  def __init__(self, fan_in: int, width: int, stride: int, *, zero_init_residual: bool,
               dtype, rngs: nnx.Rngs):
    fan_out = width * self.expansion
    self.conv1 = _conv(fan_in, width, 3, stride, dtype, rngs)
    self.bn1 = _norm(width, dtype, rngs)
    self.conv2 = _conv(width, fan_out, 3, 1, dtype, rngs)
    self.bn2 = _norm(fan_out, dtype, rngs, zero_scale=zero_init_residual)
    self._init_shortcut(fan_in, fan_out, stride, dtype, rngs)

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    y = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
    y = self.bn2(self.conv2(y), use_running_average=not train)
    return self._add_shortcut(x, y, train)


class Bottleneck(_ResidualBlock):
  """1x1 reduce, 3x3 (carrying the stride, ResNet v1.5), 1x1 expand by 4."""

  expansion = 4

  def __init__(self, fan_in: int, width: int, stride: int, *, zero_init_residual: bool,
               dtype, rngs: nnx.Rngs):
    fan_out = width * self.expansion
    self.conv1 = _conv(fan_in, width, 1, 1, dtype, rngs)
    self.bn1 = _norm(width, dtype, rngs)
    self.conv2 = _conv(width, width, 3, stride, dtype, rngs)
    self.bn2 = _norm(width, dtype, rngs)
    self.conv3 = _conv(width, fan_out, 1, 1, dtype, rngs)
    self.bn3 = _norm(fan_out, dtype, rngs, zero_scale=zero_init_residual)
    self._init_shortcut(fan_in, fan_out, stride, dtype, rngs)

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    y = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
    y = nnx.relu(self.bn2(self.conv2(y), use_running_average=not train))
    y = self.bn3(self.conv3(y), use_running_average=not train)
    return self._add_shortcut(x, y, train)


class ResNet(nnx.Module):
  """Stem, four stages of residual blocks (strides 1, 2, 2, 2), global mean pool, linear head."""

  def __init__(self, input_shape: Sequence[int], num_classes: int, *,
               block: type[BasicBlock] | type[Bottleneck], stage_sizes: Sequence[int],
               width: int = 64, small_inputs: bool = False, zero_init_residual: bool = True,
               dtype=jnp.float32, rngs: nnx.Rngs):
    """Builds the network.

    Args:
      input_shape: shape of one image (H, W, C_in).
      num_classes: number of output logits C.
      block: `BasicBlock` (ResNet-18/34) or `Bottleneck` (ResNet-50/101/152).
      stage_sizes: number of blocks in each stage, e.g. (2, 2, 2, 2).
      width: channels of the stem and the first stage (64 in the paper); stage
        i has width * 2^i (times the block expansion at its output).
      small_inputs: 3x3/1 stem without max-pool (8x8 and 32x32 images) instead
        of the 7x7/2 stem + 3x3/2 max-pool (224x224 ImageNet).
      zero_init_residual: start the last BatchNorm scale of each block at zero,
        so each residual block starts as the identity (Goyal et al. 2017).
      dtype: computation dtype (e.g. jnp.bfloat16 on accelerators); parameters
        stay float32 and the logits are returned in float32.
      rngs: parameter initialisation streams.
    """
    if len(input_shape) != 3:
      raise ValueError(f"ResNet needs images (H, W, C) as input_shape; got {tuple(input_shape)}.")
    self.small_inputs = small_inputs
    stem_kernel, stem_stride = (3, 1) if small_inputs else (7, 2)
    self.stem_conv = _conv(input_shape[-1], width, stem_kernel, stem_stride, dtype, rngs)
    self.stem_bn = _norm(width, dtype, rngs)
    names = []
    fan_in = width
    for stage, num_blocks in enumerate(stage_sizes):
      for index in range(num_blocks):
        stride = 2 if stage > 0 and index == 0 else 1
        name = f"stage{stage + 1}_block{index + 1}"
        setattr(self, name, block(fan_in, width * 2**stage, stride,
                                  zero_init_residual=zero_init_residual, dtype=dtype, rngs=rngs))
        fan_in = width * 2**stage * block.expansion
        names.append(name)
    self.block_names = tuple(names)
    self.head = nnx.Linear(fan_in, num_classes, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    """Returns float32 [B, C] logits for images [B, H, W, C_in]."""
    x = nnx.relu(self.stem_bn(self.stem_conv(x), use_running_average=not train))
    if not self.small_inputs:
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for name in self.block_names:
      x = getattr(self, name)(x, train=train)
    return self.head(jnp.mean(x, axis=(1, 2))).astype(jnp.float32)


def resnet18(input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs,
             **kwargs) -> ResNet:
  """ResNet-18: BasicBlock, stages (2, 2, 2, 2). kwargs go to `ResNet`."""
  return ResNet(input_shape, num_classes, block=BasicBlock, stage_sizes=(2, 2, 2, 2),
                rngs=rngs, **kwargs)


def resnet50(input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs,
             **kwargs) -> ResNet:
  """ResNet-50: Bottleneck, stages (3, 4, 6, 3). kwargs go to `ResNet`."""
  return ResNet(input_shape, num_classes, block=Bottleneck, stage_sizes=(3, 4, 6, 3),
                rngs=rngs, **kwargs)
