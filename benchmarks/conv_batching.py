"""A convolution vmapped over per-run kernels on a CPU: grouped, as patches, or one a run.

A batch of runs (`sera_jax.harness.batched`) vmaps each run's step over its own parameters, so a
convolution sees a kernel with a leading run axis, which JAX lowers to one grouped convolution
(feature_group_count = R). This times the kernel gradient of one 3x3 convolution of the small
CNN's second stage for R runs, six ways, in one process: XLA's convolution, the same
convolution as image patches times the kernel (im2col, a batched matmul under vmap), and the
models' `sera_jax.common.models.conv.conv_general_dilated` (one convolution a run on the CPU),
each vmapped over the runs and one run after another. Each is the seconds of R gradients.

  python benchmarks/conv_batching.py [--runs 10] [--batch 128] [--repeats 10]
"""

import argparse
import time

import jax
import jax.numpy as jnp

from sera_jax.common.models import conv

DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def convolution(images: jax.Array, kernel: jax.Array) -> jax.Array:
  """XLA's convolution: images [B, H, W, C_in], kernel [3, 3, C_in, C_out]."""
  return jax.lax.conv_general_dilated(images, kernel, (1, 1), "SAME",
                                      dimension_numbers=DIMENSIONS)


def patches_times_kernel(images: jax.Array, kernel: jax.Array) -> jax.Array:
  """The same convolution as [B, H, W, C_in * 9] patches times the flattened kernel."""
  patches = jax.lax.conv_general_dilated_patches(images, kernel.shape[:2], (1, 1), "SAME",
                                                 dimension_numbers=DIMENSIONS)
  # The patches' features are ordered (C_in, kh, kw).
  return patches @ jnp.transpose(kernel, (2, 0, 1, 3)).reshape(-1, kernel.shape[-1])


def one_a_run(images: jax.Array, kernel: jax.Array) -> jax.Array:
  """The models' convolution: XLA's, or one a run where a vmap over kernels would group it."""
  return conv.conv_general_dilated(images, kernel, (1, 1), "SAME",
                                   dimension_numbers=DIMENSIONS)


def _seconds(fn, repeats: int) -> float:
  jax.block_until_ready(fn())
  start = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(fn())
  return (time.perf_counter() - start) / repeats


def measure(runs: int, batch: int, repeats: int) -> dict[str, tuple[float, float]]:
  """{way: (seconds of R gradients vmapped, one run after another)}."""
  images_key, kernel_key = jax.random.split(jax.random.PRNGKey(0))
  images = jax.random.normal(images_key, (runs, batch, 8, 8, 32))
  kernels = 0.1 * jax.random.normal(kernel_key, (runs, 3, 3, 32, 64))
  times = {}
  for name, way in (("convolution", convolution), ("patches x kernel", patches_times_kernel),
                    ("one a run", one_a_run)):
    gradient = jax.grad(lambda kernel, images, way=way: jnp.sum(way(images, kernel) ** 2))
    batched, alone = jax.jit(jax.vmap(gradient)), jax.jit(gradient)
    times[name] = (
        _seconds(lambda batched=batched: batched(kernels, images), repeats),
        _seconds(lambda alone=alone: [alone(kernels[r], images[r]) for r in range(runs)],
                 repeats))
  return times


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=10)
  parser.add_argument("--batch", type=int, default=128, help="images a run")
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].platform}, R = {args.runs} runs of {args.batch} 8x8x32 images, "
        "3x3 kernel to 64 channels")
  print(f"{'way':<18} {'vmapped (s)':>12} {'one by one (s)':>15} {'ratio':>7}")
  for name, (batched, alone) in measure(args.runs, args.batch, args.repeats).items():
    print(f"{name:<18} {batched:>12.4f} {alone:>15.4f} {alone / batched:>7.2f}")


if __name__ == "__main__":
  main()
