"""A small convolutional policy for 8x8 / 32x32 images on a CPU.

See docs/method.md#classification-as-rl.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sera_jax.common.models import conv


class SmallCNN(nnx.Module):
  """Conv3x3-ReLU stages (2x2 average pooling between them), global mean pool, linear head.

  With `batch_norm=True` every convolution is followed by BatchNorm (statistics
  of the current batch in training, running averages in evaluation).
  """

  def __init__(self, input_shape: Sequence[int], num_classes: int, *,
               channels: Sequence[int] = (32, 64), batch_norm: bool = False,
               rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      input_shape: shape of one image (H, W, C_in).
      num_classes: number of output logits C.
      channels: output channels of each conv stage; stages after the first
        halve the spatial resolution first.
      batch_norm: add BatchNorm after each convolution.
      rngs: parameter initialisation streams.
    """
    if len(input_shape) != 3:
      raise ValueError(f"SmallCNN needs images (H, W, C) as input_shape; got {tuple(input_shape)}.")
    widths = [input_shape[-1], *channels]
    self.stage_names = tuple(f"conv{i}" for i in range(len(channels)))
    self.norm_names = tuple(f"bn{i}" for i in range(len(channels))) if batch_norm else ()
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
      setattr(self, f"conv{i}", nnx.Conv(fan_in, fan_out, (3, 3), use_bias=not batch_norm,
                                         conv_general_dilated=conv.conv_general_dilated,
                                         rngs=rngs))
      if batch_norm:
        setattr(self, f"bn{i}", nnx.BatchNorm(fan_out, momentum=0.9, rngs=rngs))
    self.head = nnx.Linear(widths[-1], num_classes, rngs=rngs)

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    """Returns [B, C] logits for images [B, H, W, C_in]."""
    for i, name in enumerate(self.stage_names):
      if i > 0 and min(x.shape[1:3]) >= 2:
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
      x = getattr(self, name)(x)
      if self.norm_names:
        x = getattr(self, self.norm_names[i])(x, use_running_average=not train)
      x = nnx.relu(x)
    return self.head(jnp.mean(x, axis=(1, 2)))
