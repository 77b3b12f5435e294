"""tensorflow-datasets input pipelines: ImageNet (manual download) and any tfds image dataset.

Augmentation of the paper's ImageNet protocol (docs/method.md#classification-as-rl):
* training: RandomResizedCrop(224, scale 0.08-1, ratio 3/4-4/3) via
  `sample_distorted_bounding_box` on the JPEG shape, decode of the crop only,
  bilinear resize, random horizontal flip;
* evaluation: resize the shorter side to 256 and take the central 224x224 crop
  (done as a central crop of 224/256 of the shorter side, then a resize);
* both normalised by the ImageNet channel mean and standard deviation.

Determinism and resumption: all randomness is stateless and keyed by
(seed, epoch, host, position in the epoch), files and examples are shuffled
with seeds derived from the same, and a step s is served by rebuilding the
epoch's pipeline and skipping the (undecoded) examples before it. So
`train_batch(s, ...)` is a function of (s, seed) like for the in-memory datasets;
consecutive steps reuse one open iterator.

TensorFlow is imported lazily and never sees the GPUs (JAX owns them).
"""

import math
import os
import shlex
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from sera_jax.common import files
from sera_jax.common.data.base import Batch, host_batch_size
from sera_jax.common.tf import tensorflow
from sera_jax.method import validation

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGENET_TARS = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")
TRAIN_AUGMENTATIONS = ("random_resized_crop", "flip", "none")
EVAL_PREPROCESSINGS = ("center_crop", "resize")
# Shorter side 256 -> central 224: the crop keeps 224/256 of the shorter side.
_CENTER_CROP_FRACTION = 224 / 256


def tensorflow_and_tfds() -> tuple[Any, Any]:
  """(tensorflow with the GPUs hidden, tensorflow_datasets)."""
  tf = tensorflow()
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  return tf, tfds


def _is_imagenet(name: str) -> bool:
  return name.split(":")[0].split("/")[0] == "imagenet2012"


def tfds_is_mocked(tfds) -> bool:
  """Whether `tfds.testing.mock_data` is active (it serves examples without prepared files).

  The mock swaps in a no-op `download_and_prepare` of this name.
  """
  return tfds.core.DatasetBuilder.download_and_prepare.__name__ == "mock_download_and_prepare"


def unprepared_message(name: str, data_dir: str) -> str:
  """What to run to prepare the tfds dataset `name` in `data_dir` (ImageNet: the archives)."""
  if _is_imagenet(name):
    manual_dir = files.path(data_dir) / "downloads" / "manual"
    present = [f for f in IMAGENET_TARS if (manual_dir / f).exists()]
    missing = [f for f in IMAGENET_TARS if f not in present]
    state = (f"missing there now: {', '.join(missing)}" if missing
             else "both archives are there, but the dataset has not been built")
    return (f"ImageNet ({name}) is not prepared in data_dir={data_dir!r}. Download "
            f"{' and '.join(IMAGENET_TARS)} from https://image-net.org into {manual_dir}/ "
            f"({state}), then build the dataset once (about 150 GB, hours) with:\n"
            f"  tfds build imagenet2012 --data_dir={shlex.quote(str(data_dir))} "
            f"--manual_dir={shlex.quote(str(manual_dir))}")
  return (f"tfds dataset {name!r} is not prepared in data_dir={data_dir!r}. Prepare it once "
          f"(this downloads it) with:\n  tfds build {name.split(':')[0]} "
          f"--data_dir={shlex.quote(str(data_dir))}")


class TfdsImageDataset:
  """A tfds image-classification dataset as an `ImageDataset` (see sera_jax.data.base).

  Attributes:
    name: tfds name (with optional config/version), e.g. "imagenet2012".
    num_classes: number of labels of the `label_key` ClassLabel feature.
    image_shape: (image_size, image_size, channels) of the served images.
    num_train: examples of the training split.
    num_eval: examples of the evaluation split.
  """

  def __init__(self, name: str, *, data_dir: str | None = None, train_split: str = "train",
               eval_split: str | None = None, image_size: int | None = None,
               train_augmentation: str | None = None, eval_preprocessing: str | None = None,
               mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
               shuffle_buffer: int = 10_000, image_key: str = "image",
               label_key: str = "label"):
    """Opens the dataset; raises at once if its files are not prepared.

    Args:
      name: tfds dataset name, e.g. "imagenet2012", "cifar10", "mnist:3.0.1".
      data_dir: tfds data directory (None: the tfds default, ~/tensorflow_datasets).
      train_split: training split (any tfds split string, e.g. "train[:90%]").
      eval_split: held-out split; default "validation" for ImageNet, else "test".
      image_size: side of the square images served; default 224 for ImageNet,
        else the dataset's own size (required when it varies).
      train_augmentation: "random_resized_crop" (ImageNet default: scale
        0.08-1, ratio 3/4-4/3, + flip), "flip" (resize + flip; the default
        otherwise) or "none" (resize).
      eval_preprocessing: "center_crop" (ImageNet default: resize 256, central
        224) or "resize" (the default otherwise).
      mean: per-channel mean of [0, 1] pixels; default ImageNet's for 3
        channels, 0.5 otherwise.
      std: per-channel standard deviation; default ImageNet's for 3 channels,
        0.5 otherwise.
      shuffle_buffer: examples in the (undecoded) shuffle buffer.
      image_key: image feature name.
      label_key: ClassLabel feature name.

    Raises:
      FileNotFoundError: the dataset is not prepared in data_dir; the message
        says where the files go and which `tfds build` command prepares them.
    """
    tf, tfds = tensorflow_and_tfds()
    imagenet = _is_imagenet(name)
    self.name = name
    self._builder = tfds.builder(name, data_dir=data_dir)
    if not (self._builder.is_prepared() or tfds_is_mocked(tfds)):
      raise FileNotFoundError(unprepared_message(
          name, data_dir or os.fspath(self._builder.data_dir_root)))
    features = self._builder.info.features
    for key in (image_key, label_key):
      if key not in features:
        raise ValueError(f"tfds dataset {name!r} has no feature {key!r}; it has "
                         f"{', '.join(features.keys())}.")
    self._image_key, self._label_key = image_key, label_key
    self.num_classes = int(features[label_key].num_classes)
    stored_shape = features[image_key].shape
    channels = stored_shape[-1]
    if channels is None:
      raise ValueError(f"tfds dataset {name!r} does not fix the number of image channels.")
    if image_size is None:
      if imagenet:
        image_size = 224
      elif stored_shape[0] is not None and stored_shape[0] == stored_shape[1]:
        image_size = stored_shape[0]
      else:
        raise ValueError(f"tfds dataset {name!r} has images of shape {stored_shape}; "
                         f"pass image_size.")
    self._image_size = validation.integer("image_size", image_size, minimum=1)
    self.image_shape = (self._image_size, self._image_size, int(channels))
    self._train_augmentation = validation.choice(
        "train_augmentation",
        train_augmentation or ("random_resized_crop" if imagenet else "flip"),
        TRAIN_AUGMENTATIONS)
    self._eval_preprocessing = validation.choice(
        "eval_preprocessing", eval_preprocessing or ("center_crop" if imagenet else "resize"),
        EVAL_PREPROCESSINGS)
    default_mean, default_std = ((IMAGENET_MEAN, IMAGENET_STD) if channels == 3
                                 else ((0.5,) * channels, (0.5,) * channels))
    self._mean = tf.constant(mean or default_mean, tf.float32)
    self._std = tf.constant(std or default_std, tf.float32)
    if self._mean.shape != (channels,) or self._std.shape != (channels,):
      raise ValueError(f"mean and std need {channels} entries (one per channel).")
    self._shuffle_buffer = validation.integer("shuffle_buffer", shuffle_buffer, minimum=1)
    self._train_split = train_split
    self._split_sizes: dict[tuple[str, int, int], int] = {}
    self._eval_split = eval_split or ("validation" if imagenet else "test")
    self.num_train = self._split_size(self._train_split, 0, 1)
    self.num_eval = self._split_size(self._eval_split, 0, 1)
    self._cursor: tuple[tuple[int, ...], int, Iterator[Batch]] | None = None

  # ---------------------------------------------------------------- interface

  def steps_per_epoch(self, batch_size: int, *, process_count: int = 1) -> int:
    """Global batches per epoch: every host serves as many batches as the smallest host can."""
    per_host = host_batch_size(batch_size, 0, process_count)
    smallest = min(self._split_size(self._train_split, i, process_count)
                   for i in range(process_count))
    if per_host > smallest:
      raise ValueError(f"the per-host batch size {per_host} exceeds the {smallest} training "
                       f"examples of the smallest host's share of {self.name!r}.")
    return smallest // per_host

  def train_batch(self, step: int, batch_size: int, seed: int, *, process_index: int = 0,
                  process_count: int = 1) -> Batch:
    """This host's part of the training batch of `step` (see `ImageDataset`).

    Each host reads its own share of the split (`tfds.split_for_jax_process`),
    so the hosts' batches together form the global batch.
    """
    per_host = host_batch_size(batch_size, process_index, process_count)
    step = validation.integer("step", step, minimum=0)
    seed = validation.integer("seed", seed, minimum=0)
    stream = (batch_size, seed, process_index, process_count)
    if self._cursor is not None and self._cursor[:2] == (stream, step):
      iterator = self._cursor[2]
    else:
      epoch, position = divmod(step, self.steps_per_epoch(batch_size,
                                                          process_count=process_count))
      iterator = self._epoch_batches(epoch, position, per_host, seed, process_index,
                                     process_count)
    batch = next(iterator, None)
    if batch is None:  # The epoch ended: the next step opens the following epoch.
      self._cursor = None
      return self.train_batch(step, batch_size, seed, process_index=process_index,
                              process_count=process_count)
    self._cursor = (stream, step + 1, iterator)
    return batch

  def eval_batches(self, batch_size: int, *, process_index: int = 0,
                   process_count: int = 1) -> Iterator[Batch]:
    """One pass over this host's share of the eval split, in file order (see `ImageDataset`).

    Every host yields the same number of batches (the largest share's), padded
    with mask False rows, so hosts stay in step in a collective evaluation.
    """
    per_host = host_batch_size(batch_size, process_index, process_count)
    return self._eval_batches(per_host, process_index, process_count)

  # ---------------------------------------------------------------- pipeline

  def _eval_batches(self, per_host: int, process_index: int,
                    process_count: int) -> Iterator[Batch]:
    tf, _ = tensorflow_and_tfds()
    largest = max(self._split_size(self._eval_split, i, process_count)
                  for i in range(process_count))
    num_batches = math.ceil(largest / per_host)
    examples = self._examples(self._eval_split, process_index, process_count,
                              shuffle_seed=None)
    real = examples.map(lambda example: self._preprocess_eval(example),
                        num_parallel_calls=tf.data.AUTOTUNE)
    size = self._split_size(self._eval_split, process_index, process_count)
    padding = tf.data.Dataset.from_tensors({
        "image": tf.zeros(self.image_shape, tf.float32),
        "label": tf.zeros((), tf.int32),
        "mask": tf.constant(False),
    }).repeat(num_batches * per_host - size)
    batches = real.concatenate(padding).batch(per_host, drop_remainder=True)
    return batches.prefetch(tf.data.AUTOTUNE).as_numpy_iterator()

  def _split_size(self, split: str, process_index: int, process_count: int) -> int:
    """Examples in one host's share of a split (memoised: building a dataset costs ~10 ms)."""
    key = (split, process_index, process_count)
    if key not in self._split_sizes:
      size = int(self._examples(split, process_index, process_count, shuffle_seed=None)
                 .cardinality())
      if size < 0:
        raise ValueError(f"tfds could not tell the size of split {split!r} of {self.name!r}.")
      if size == 0:
        raise ValueError(f"split {split!r} of {self.name!r} is empty for host "
                         f"{process_index} of {process_count}.")
      self._split_sizes[key] = size
    return self._split_sizes[key]

  def _examples(self, split: str, process_index: int, process_count: int, *,
                shuffle_seed: int | None):
    """This host's undecoded examples; files shuffled with `shuffle_seed` when given."""
    tf, tfds = tensorflow_and_tfds()
    host_split = tfds.split_for_jax_process(split, process_index=process_index,
                                            process_count=process_count)
    options = tf.data.Options()
    options.deterministic = True
    read_config = tfds.ReadConfig(options=options, shuffle_seed=shuffle_seed,
                                  shuffle_reshuffle_each_iteration=False)
    return self._builder.as_dataset(
        split=host_split, shuffle_files=shuffle_seed is not None, read_config=read_config,
        decoders={self._image_key: tfds.decode.SkipDecoding()})

  def _epoch_batches(self, epoch: int, position: int, per_host: int, seed: int,
                     process_index: int, process_count: int) -> Iterator[Batch]:
    """Batches `position`, `position` + 1, ... of `epoch` for one host."""
    tf, _ = tensorflow_and_tfds()
    steps = self.steps_per_epoch(per_host * process_count, process_count=process_count)
    epoch_seed = int(np.random.SeedSequence((seed, epoch, process_index)).generate_state(1)[0]
                     >> 1)  # 31 bits: tf and tfds take signed 32/64-bit seeds.
    examples = self._examples(self._train_split, process_index, process_count,
                              shuffle_seed=epoch_seed)
    examples = examples.shuffle(self._shuffle_buffer, seed=epoch_seed,
                                reshuffle_each_iteration=False)
    # Skip the examples of earlier steps before decoding anything (resumption).
    examples = examples.take(steps * per_host).enumerate().skip(position * per_host)
    batches = examples.map(
        lambda index, example: self._preprocess_train(example, tf.stack(
            [tf.constant(epoch_seed, tf.int64), index])),
        num_parallel_calls=tf.data.AUTOTUNE).batch(per_host, drop_remainder=True)
    return batches.prefetch(tf.data.AUTOTUNE).as_numpy_iterator()

  def _decode_window(self, encoded, window_fn):
    """Decodes the window `window_fn(image_shape) -> [y, x, h, w]` of an encoded image.

    JPEGs decode only the window; other formats (PNG, ...) decode, then slice.
    """
    tf, _ = tensorflow_and_tfds()
    channels = self.image_shape[-1]

    def jpeg():
      window = window_fn(tf.image.extract_jpeg_shape(encoded))
      return tf.image.decode_and_crop_jpeg(encoded, window, channels=channels)

    def other():
      image = tf.io.decode_image(encoded, channels=channels, expand_animations=False)
      window = window_fn(tf.shape(image))
      return tf.slice(image, [window[0], window[1], 0], [window[2], window[3], channels])

    image = tf.cond(tf.io.is_jpeg(encoded), jpeg, other)
    image.set_shape([None, None, channels])
    return image

  def _finish(self, image, label, **extra):
    """Resizes to image_size (bilinear) and normalises to float32 with mean/std."""
    tf, _ = tensorflow_and_tfds()
    image = tf.image.resize(image, [self._image_size, self._image_size], method="bilinear")
    image = (image / 255.0 - self._mean) / self._std
    return {"image": tf.cast(image, tf.float32), "label": tf.cast(label, tf.int32), **extra}

  def _preprocess_train(self, example, seed):
    tf, _ = tensorflow_and_tfds()
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))

    def random_resized_crop(shape):
      begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
          shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=crop_seed,
          min_object_covered=0.0, aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0),
          max_attempts=10, use_image_if_no_bounding_boxes=True)
      return tf.stack([begin[0], begin[1], size[0], size[1]])

    window_fn = (random_resized_crop if self._train_augmentation == "random_resized_crop"
                 else _full_window)
    image = self._decode_window(example[self._image_key], window_fn)
    if self._train_augmentation != "none":
      image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    return self._finish(image, example[self._label_key])

  def _preprocess_eval(self, example):
    tf, _ = tensorflow_and_tfds()

    def center_crop(shape):
      side = tf.cast(_CENTER_CROP_FRACTION * tf.cast(tf.minimum(shape[0], shape[1]),
                                                     tf.float32), tf.int32)
      return tf.stack([(shape[0] - side + 1) // 2, (shape[1] - side + 1) // 2, side, side])

    window_fn = center_crop if self._eval_preprocessing == "center_crop" else _full_window
    image = self._decode_window(example[self._image_key], window_fn)
    return self._finish(image, example[self._label_key], mask=tf.constant(True))


def _full_window(shape):
  tf, _ = tensorflow_and_tfds()
  return tf.stack([0, 0, shape[0], shape[1]])


def tfds_images(name: str, **kwargs) -> TfdsImageDataset:
  """Any tfds image-classification dataset; kwargs as for `TfdsImageDataset`."""
  return TfdsImageDataset(name, **kwargs)


def imagenet2012(data_dir: str | None = None, **kwargs) -> TfdsImageDataset:
  """ImageNet-1k (tfds "imagenet2012", manual download) with the paper's protocol.

  The protocol is that of docs/method.md#classification-as-rl.

  The two archives ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar go in
  <data_dir>/downloads/manual/; build once with
  `tfds build imagenet2012 --data_dir=<data_dir> --manual_dir=<data_dir>/downloads/manual`.
  """
  return TfdsImageDataset("imagenet2012", data_dir=data_dir, **kwargs)
