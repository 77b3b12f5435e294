"""The dataset interface of classification as RL, and in-memory datasets.

See docs/method.md#classification-as-rl.

Every dataset serves
* `train_batch(step, batch_size, seed)`: the training batch of a step, a pure
  function of (step, seed): the data position of a run *is* its step, so a
  resumed run reads exactly the batches an uninterrupted run would have read;
* `eval_batches(batch_size)`: one pass over the held-out split in a fixed order,
  every batch of the same shape (the last one padded, with `mask` marking the
  real examples) so a jitted evaluation compiles once.

Per-host sharding: with `process_count` hosts each host receives its own
contiguous slice of the global batch (`batch_size` is global and must divide
by `process_count`).
"""

import dataclasses
import math
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from sera_jax.method import validation

Batch = dict[str, np.ndarray]


class ImageDataset(Protocol):
  """What the trainer needs from a dataset."""

  name: str
  num_classes: int
  image_shape: tuple[int, ...]
  num_train: int
  num_eval: int

  def steps_per_epoch(self, batch_size: int) -> int:
    """Number of global training batches in one epoch (the last partial batch is dropped)."""

  def train_batch(self, step: int, batch_size: int, seed: int, *, process_index: int = 0,
                  process_count: int = 1) -> Batch:
    """This host's part of the global training batch of `step`.

    Returns:
      dict(image=float32 [batch_size // process_count, *image_shape],
           label=int32 [batch_size // process_count]).
    """

  def eval_batches(self, batch_size: int, *, process_index: int = 0,
                   process_count: int = 1) -> Iterator[Batch]:
    """One pass over the held-out split in a fixed order.

    Yields:
      dict(image=float32 [b, *image_shape], label=int32 [b], mask=bool [b]) with
      b = batch_size // process_count; padding rows have mask False.
    """


def host_batch_size(batch_size: int, process_index: int, process_count: int) -> int:
  """Checks the sharding arguments and returns the per-host batch size."""
  batch_size = validation.integer("batch_size", batch_size, minimum=1)
  process_count = validation.integer("process_count", process_count, minimum=1)
  process_index = validation.integer("process_index", process_index, minimum=0)
  if process_index >= process_count:
    raise ValueError(f"process_index must be < process_count = {process_count}; "
                     f"got {process_index}.")
  if batch_size % process_count:
    raise ValueError(f"the global batch_size {batch_size} must be divisible by process_count "
                     f"{process_count} (each host loads batch_size / process_count examples).")
  return batch_size // process_count


@dataclasses.dataclass(frozen=True, eq=False)
class ArrayDataset:
  """A dataset held in memory as NumPy arrays; implements `ImageDataset`.

  Epoch e visits the training set in the order of
  `np.random.default_rng((seed, e)).permutation(num_train)`; step s reads the
  (s mod steps_per_epoch)-th block of batch_size indices of epoch
  s // steps_per_epoch.
  """

  name: str
  num_classes: int
  train_images: np.ndarray
  train_labels: np.ndarray
  eval_images: np.ndarray
  eval_labels: np.ndarray
  # A validation split drawn like the training set, disjoint from it and from the held-out
  # split: hyperparameters are chosen on it, never on the held-out split (empty: none).
  validation_images: np.ndarray | None = None
  validation_labels: np.ndarray | None = None

  def __post_init__(self):
    if self.validation_images is None:
      shape = (0, *self.train_images.shape[1:])
      object.__setattr__(self, "validation_images", np.zeros(shape, np.float32))
      object.__setattr__(self, "validation_labels", np.zeros((0,), np.int32))
    for split in ("train", "eval", "validation"):
      images, labels = getattr(self, f"{split}_images"), getattr(self, f"{split}_labels")
      if images.dtype != np.float32 or labels.dtype != np.int32:
        raise TypeError(f"{split} images/labels must be float32/int32; got "
                        f"{images.dtype}/{labels.dtype}.")
      if images.shape[0] != labels.shape[0] or labels.ndim != 1:
        raise ValueError(f"{split} images {images.shape} and labels {labels.shape} disagree.")
      if labels.size and not 0 <= labels.min() <= labels.max() < self.num_classes:
        raise ValueError(f"{split} labels must lie in [0, {self.num_classes}).")
    if not self.train_images.shape[1:] == self.eval_images.shape[1:] == (
        self.validation_images.shape[1:]):
      raise ValueError("train, eval and validation images must have the same shape.")

  @property
  def image_shape(self) -> tuple[int, ...]:
    return tuple(self.train_images.shape[1:])

  @property
  def num_train(self) -> int:
    return int(self.train_labels.shape[0])

  @property
  def num_eval(self) -> int:
    return int(self.eval_labels.shape[0])

  @property
  def num_validation(self) -> int:
    return int(self.validation_labels.shape[0])

  def validation_split(self) -> "ArrayDataset":
    """This dataset with its validation split in the place of the held-out split."""
    if not self.num_validation:
      raise ValueError(f"the {self.name!r} dataset has no validation split; give it "
                       f"dataset_kwargs.num_validation > 0.")
    return dataclasses.replace(self, eval_images=self.validation_images,
                               eval_labels=self.validation_labels)

  def steps_per_epoch(self, batch_size: int) -> int:
    batch_size = validation.integer("batch_size", batch_size, minimum=1)
    if batch_size > self.num_train:
      raise ValueError(f"batch_size {batch_size} exceeds the {self.num_train} training "
                       f"examples of {self.name!r}.")
    return self.num_train // batch_size

  def train_batch(self, step: int, batch_size: int, seed: int, *, process_index: int = 0,
                  process_count: int = 1) -> Batch:
    per_host = host_batch_size(batch_size, process_index, process_count)
    step = validation.integer("step", step, minimum=0)
    seed = validation.integer("seed", seed, minimum=0)
    epoch, position = divmod(step, self.steps_per_epoch(batch_size))
    start = position * batch_size + process_index * per_host
    # O(num_train) per call: cheap next to a training step, and keeps the batch a
    # pure function of (step, seed).
    order = np.random.default_rng((seed, epoch)).permutation(self.num_train)
    rows = order[start:start + per_host]
    return {"image": self.train_images[rows], "label": self.train_labels[rows]}

  def eval_batches(self, batch_size: int, *, process_index: int = 0,
                   process_count: int = 1) -> Iterator[Batch]:
    per_host = host_batch_size(batch_size, process_index, process_count)
    return self._eval_batches(batch_size, per_host, process_index)

  def _eval_batches(self, batch_size: int, per_host: int, process_index: int) -> Iterator[Batch]:
    for start in range(0, math.ceil(self.num_eval / batch_size) * batch_size, batch_size):
      rows = np.arange(start + process_index * per_host, start + (process_index + 1) * per_host)
      rows = rows[rows < self.num_eval]
      yield pad_batch(self.eval_images[rows], self.eval_labels[rows], per_host)


def pad_batch(images: np.ndarray, labels: np.ndarray, size: int) -> Batch:
  """Pads an evaluation batch to `size` rows with zeros; `mask` marks the real rows."""
  real = labels.shape[0]
  pad = size - real
  return {
      "image": np.concatenate([images, np.zeros((pad, *images.shape[1:]), images.dtype)]),
      "label": np.concatenate([labels, np.zeros((pad,), labels.dtype)]),
      "mask": np.arange(size) < real,
  }
