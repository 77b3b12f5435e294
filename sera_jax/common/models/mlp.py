"""A multi-layer perceptron policy for small vectors and 8x8 images.

See docs/method.md#classification-as-rl.
"""

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
  """Flattens each example and applies Linear-ReLU layers, then a linear head.

  The logits parameterise the policy pi(a | x) = softmax(logits)[a] of the
  classification-as-RL setting (docs/method.md#classification-as-rl). No normalisation layers,
  so the functional wrapper returns empty batch statistics.
  """

  def __init__(self, input_shape: Sequence[int], num_classes: int, *,
               hidden_sizes: Sequence[int] = (128, 128), rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      input_shape: shape of one example, e.g. (8, 8, 1) or (64,).
      num_classes: number of output logits C.
      hidden_sizes: widths of the hidden layers (may be empty: a linear model).
      rngs: parameter initialisation streams.
    """
    widths = [math.prod(input_shape), *hidden_sizes]
    # Named attributes (not a list) keep the parameter dict's keys strings,
    # which round-trip through checkpoints unchanged.
    self.hidden_names = tuple(f"dense{i}" for i in range(len(hidden_sizes)))
    for name, fan_in, fan_out in zip(self.hidden_names, widths[:-1], widths[1:], strict=True):
      setattr(self, name, nnx.Linear(fan_in, fan_out, rngs=rngs))
    self.head = nnx.Linear(widths[-1], num_classes, rngs=rngs)

  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    """Returns [B, C] logits for a batch of examples [B, *input_shape]."""
    del train  # No train/eval-dependent layers.
    x = jnp.reshape(x, (x.shape[0], -1))
    for name in self.hidden_names:
      x = nnx.relu(getattr(self, name)(x))
    return self.head(x)
