"""A generated many-class dataset that reproduces the ImageNet cold start on a CPU.

See docs/method.md#classification-as-rl.

Each class c has a random prototype m_c ~ N(0, I_d); an example of class c is
x = (m_c + noise * e) / sqrt(1 + noise^2) with e ~ N(0, I_d), so every input
coordinate has unit variance. With C = 1000 classes a freshly initialised
network gives the true class p ~ 1/C (the regime of ImageNet from scratch),
yet the classes are separable enough to learn in a few hundred CPU steps.
"""

import math
from collections.abc import Sequence

import numpy as np

from sera_jax.common.data.base import ArrayDataset
from sera_jax.method import validation


def synthetic(*, num_classes: int = 1000, num_train: int = 50_000, num_eval: int = 10_000,
              num_validation: int = 0, image_shape: Sequence[int] = (8, 8, 1), noise: float = 1.0,
              seed: int = 0) -> ArrayDataset:
  """Class prototypes plus Gaussian noise, balanced classes, no downloads.

  Args:
    num_classes: number of classes C.
    num_train: training examples (class i % C for example i, then shuffled).
    num_eval: held-out examples from the same prototypes with fresh noise.
    num_validation: validation examples, likewise (a noise stream of their own).
    image_shape: shape of one example, e.g. (8, 8, 1) or (64,).
    noise: noise standard deviation relative to the prototypes' (> 0).
    seed: seed of prototypes, labels and noise.
  """
  num_classes = validation.integer("num_classes", num_classes, minimum=2)
  num_train = validation.integer("num_train", num_train, minimum=1)
  num_eval = validation.integer("num_eval", num_eval, minimum=1)
  num_validation = validation.integer("num_validation", num_validation, minimum=0)
  image_shape = tuple(validation.integer("image_shape entry", d, minimum=1)
                      for d in image_shape)
  seed = validation.integer("seed", seed, minimum=0)
  noise = float(noise)
  if not noise > 0:
    raise ValueError(f"noise must be > 0; got {noise}.")
  dim = math.prod(image_shape)
  # spawn(n)'s first children do not depend on n: adding the validation stream kept the others.
  prototype_rng, train_rng, eval_rng, validation_rng = (
      np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))
  prototypes = prototype_rng.standard_normal((num_classes, dim))

  def sample(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.permutation(np.arange(count) % num_classes).astype(np.int32)
    points = prototypes[labels] + noise * rng.standard_normal((count, dim))
    images = (points / math.sqrt(1.0 + noise**2)).astype(np.float32)
    return images.reshape(count, *image_shape), labels

  train_images, train_labels = sample(train_rng, num_train)
  eval_images, eval_labels = sample(eval_rng, num_eval)
  validation_images, validation_labels = sample(validation_rng, num_validation)
  return ArrayDataset(name="synthetic", num_classes=num_classes,
                      train_images=train_images, train_labels=train_labels,
                      eval_images=eval_images, eval_labels=eval_labels,
                      validation_images=validation_images, validation_labels=validation_labels)
