"""A convolution that a batch of runs maps over on the CPU as one convolution a run.

A batch of runs (`sera_jax.common.batching`) vmaps each run's step over its own parameters,
so a convolution sees a kernel with a leading run axis. JAX batches that as one grouped
convolution (feature_group_count times R), which XLA's CPU backend runs five to ten times
slower than the R convolutions one by one (`benchmarks/conv_batching.py`); GPUs and TPUs have
grouped convolutions as native kernels (cuDNN's, for one). `conv_general_dilated` is
`jax.lax.conv_general_dilated` for a run alone, with the same values and gradients; where a
vmap would group it (a mapped kernel; for the kernel's gradient, mapped images and
cotangents), the program lowered for the CPU runs one convolution per mapped slice instead,
and the program lowered for any other platform keeps JAX's grouped convolution.
"""

import jax

from sera_jax.common import batching


def conv_general_dilated(lhs: jax.Array, rhs: jax.Array, *args, **kwargs) -> jax.Array:
  """`jax.lax.conv_general_dilated(lhs, rhs, *args, **kwargs)` (images `lhs`, kernel `rhs`),
  batched over a mapped kernel as one convolution a slice on the CPU (the module's docstring);
  `nnx.Conv(..., conv_general_dilated=conv_general_dilated)` uses it."""

  def convolution(images, kernel):
    return jax.lax.conv_general_dilated(images, kernel, *args, **kwargs)

  def convolution_vjp(images, kernel, cotangent):
    # Linear in each argument: the transposes, without the forward pass a `jax.vjp` adds.
    images_gradient, = jax.linear_transpose(lambda x: convolution(x, kernel), images)(cotangent)
    kernel_gradient, = jax.linear_transpose(lambda k: convolution(images, k), kernel)(cotangent)
    return images_gradient, kernel_gradient

  # JAX groups a convolution whose kernel is mapped, and the kernel's gradient (a
  # convolution of the images with the cotangent) when both of those are mapped.
  # Unrolled: XLA's CPU backend runs a convolution inside its loops many times slower.
  forward = batching.sliced_on_cpu(convolution, lambda _, mapped, *arrays: mapped[1],
                                   unroll=True)
  backward = batching.sliced_on_cpu(
      convolution_vjp, lambda _, mapped, *arrays: mapped[1] or (mapped[0] and mapped[2]),
      unroll=True)

  @jax.custom_vjp
  def conv(images, kernel):
    return forward(images, kernel)

  def conv_forward(images, kernel):
    return forward(images, kernel), (images, kernel)

  def conv_backward(residuals, cotangent):
    return backward(*residuals, cotangent)

  conv.defvjp(conv_forward, conv_backward)
  return conv(lhs, rhs)
