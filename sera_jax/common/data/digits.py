"""The embedded default dataset: scikit-learn's 8x8 handwritten digits (no download)."""

import numpy as np
from sklearn import datasets as sk_datasets

from sera_jax.common.data.base import ArrayDataset
from sera_jax.method import validation

NUM_DIGITS = 1797


def digits(*, num_eval: int = 360, num_validation: int = 0, split_seed: int = 0) -> ArrayDataset:
  """The 1797 8x8 digits of `sklearn.datasets.load_digits`, 10 classes.

  A seeded permutation holds out `num_eval` images (default 1437 train / 360
  eval); `num_validation` more are taken out of the training images as a
  validation split. Pixels (0..16) are standardised with the mean and standard deviation
  of the training pixels (one scalar each, so the constant border pixels
  stay finite). Images are float32 [8, 8, 1].

  Args:
    num_eval: held-out examples.
    num_validation: validation examples, taken from the training examples.
    split_seed: seed of the train/eval permutation.
  """
  num_eval = validation.integer("num_eval", num_eval, minimum=1)
  num_validation = validation.integer("num_validation", num_validation, minimum=0)
  if num_eval + num_validation >= NUM_DIGITS:
    raise ValueError(f"num_eval + num_validation must be < {NUM_DIGITS}; got "
                     f"{num_eval} + {num_validation}.")
  split_seed = validation.integer("split_seed", split_seed, minimum=0)
  raw = sk_datasets.load_digits()
  images = raw.images.astype(np.float64)[..., None]
  labels = raw.target.astype(np.int32)
  order = np.random.default_rng(split_seed).permutation(NUM_DIGITS)
  eval_rows, train_rows = order[:num_eval], order[num_eval + num_validation:]
  validation_rows = order[num_eval:num_eval + num_validation]
  mean, std = images[train_rows].mean(), images[train_rows].std()
  images = ((images - mean) / std).astype(np.float32)
  return ArrayDataset(name="digits", num_classes=10,
                      train_images=images[train_rows], train_labels=labels[train_rows],
                      eval_images=images[eval_rows], eval_labels=labels[eval_rows],
                      validation_images=images[validation_rows],
                      validation_labels=labels[validation_rows])
