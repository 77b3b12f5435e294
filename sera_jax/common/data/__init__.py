"""Input pipelines of the classification-as-RL setting (docs/method.md#classification-as-rl).

`get_dataset(name, **kwargs)`:
* "digits": scikit-learn's embedded 8x8 digits (the default, no download);
* "synthetic": a generated many-class dataset (C = 1000 by default) that
  reproduces the ImageNet cold start p ~ 1/C on a CPU;
* "imagenet2012" (or "tfds:imagenet2012"): ImageNet from a manually
  downloaded tfds data_dir, with the paper's augmentation;
* "tfds:<name>": any prepared tfds image-classification dataset.
All follow the `ImageDataset` interface (deterministic, resumable batches by step).
"""

from typing import Any

from sera_jax.common.data.base import ArrayDataset, Batch, ImageDataset, host_batch_size, pad_batch
from sera_jax.common.data.digits import digits
from sera_jax.common.data.synthetic import synthetic
from sera_jax.common.data.tfds_images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TfdsImageDataset,
    imagenet2012,
    tfds_images,
)

DATASET_NAMES = ("digits", "synthetic", "imagenet2012", "tfds:<name>")


def get_dataset(name: str, **kwargs: Any) -> ImageDataset:
  """Builds the dataset called `name` (one of DATASET_NAMES); kwargs go to its constructor."""
  if name == "digits":
    return digits(**kwargs)
  if name == "synthetic":
    return synthetic(**kwargs)
  if name == "imagenet2012":
    return imagenet2012(**kwargs)
  if name.startswith("tfds:") and len(name) > len("tfds:"):
    return tfds_images(name.removeprefix("tfds:"), **kwargs)
  raise ValueError(f"unknown dataset {name!r}; expected one of "
                   f"{', '.join(map(repr, DATASET_NAMES))}.")


__all__ = [
    "DATASET_NAMES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ArrayDataset",
    "Batch",
    "ImageDataset",
    "TfdsImageDataset",
    "digits",
    "get_dataset",
    "host_batch_size",
    "imagenet2012",
    "pad_batch",
    "synthetic",
    "tfds_images",
]
