"""Tests for sera_jax.data: determinism, resumption and per-host sharding of every pipeline."""

import os
import shlex

import numpy as np
import pytest
from absl.testing import absltest, parameterized

from sera_jax.common import data
from sera_jax.common.data.tfds_images import tensorflow_and_tfds


def _assert_batches_equal(a: data.Batch, b: data.Batch) -> None:
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


class DigitsTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.dataset = data.get_dataset("digits")

  def test_shapes_split_and_standardisation(self):
    ds = self.dataset
    self.assertEqual((ds.num_classes, ds.image_shape, ds.num_train, ds.num_eval),
                     (10, (8, 8, 1), 1437, 360))
    batch = ds.train_batch(0, 32, seed=0)
    self.assertEqual(batch["image"].shape, (32, 8, 8, 1))
    self.assertEqual(batch["image"].dtype, np.float32)
    self.assertEqual(batch["label"].dtype, np.int32)
    self.assertAlmostEqual(float(ds.train_images.mean()), 0.0, places=5)
    self.assertAlmostEqual(float(ds.train_images.std()), 1.0, places=5)
    # Train and eval images are disjoint rows of the 1797 digits.
    train_rows = {row.tobytes() for row in ds.train_images}
    self.assertFalse(any(row.tobytes() in train_rows for row in ds.eval_images[:50]))

  def test_batches_are_a_function_of_step_and_seed(self):
    fresh = data.digits()  # A resumed run builds its dataset again.
    for step in (0, 5, 13, 14, 100):
      _assert_batches_equal(self.dataset.train_batch(step, 100, seed=7),
                            fresh.train_batch(step, 100, seed=7))
    self.assertFalse(np.array_equal(self.dataset.train_batch(3, 100, seed=7)["label"],
                                    self.dataset.train_batch(3, 100, seed=8)["label"]))

  def test_an_epoch_visits_distinct_examples_and_the_next_reshuffles(self):
    ds, batch_size = self.dataset, 100
    steps = ds.steps_per_epoch(batch_size)
    self.assertEqual(steps, 14)
    epoch = np.concatenate([ds.train_batch(s, batch_size, 1)["image"] for s in range(steps)])
    self.assertEqual(len({row.tobytes() for row in epoch}), steps * batch_size)
    first, second = ds.train_batch(0, batch_size, 1), ds.train_batch(steps, batch_size, 1)
    self.assertFalse(np.array_equal(first["image"], second["image"]))

  @parameterized.parameters(2, 4)
  def test_host_slices_concatenate_to_the_global_batch(self, process_count):
    ds = self.dataset
    for step in (0, 20):
      whole = ds.train_batch(step, 64, seed=3)
      parts = [ds.train_batch(step, 64, seed=3, process_index=i, process_count=process_count)
               for i in range(process_count)]
      _assert_batches_equal(whole, {k: np.concatenate([p[k] for p in parts]) for k in whole})

  def test_bad_sharding_and_batch_arguments_are_rejected(self):
    ds = self.dataset
    with self.assertRaisesRegex(ValueError, "batch_size 10 must be divisible by process_count 3"):
      ds.train_batch(0, 10, seed=0, process_index=0, process_count=3)
    with self.assertRaisesRegex(ValueError, "process_index must be < process_count"):
      ds.train_batch(0, 10, seed=0, process_index=2, process_count=2)
    with self.assertRaisesRegex(ValueError, "exceeds the 1437 training examples"):
      ds.train_batch(0, 2000, seed=0)
    with self.assertRaisesRegex(ValueError, "process_count"):
      ds.eval_batches(10, process_count=3)  # Raised at the call, not at the first batch.

  def test_eval_pass_covers_the_split_once_with_fixed_shapes(self):
    ds = self.dataset
    batches = list(ds.eval_batches(100))
    self.assertEqual(len(batches), 4)
    for batch in batches:
      self.assertEqual(batch["image"].shape, (100, 8, 8, 1))
    images = np.concatenate([b["image"][b["mask"]] for b in batches])
    np.testing.assert_array_equal(images, ds.eval_images)
    self.assertEqual(int(batches[-1]["mask"].sum()), 60)
    per_host = [list(ds.eval_batches(100, process_index=i, process_count=2)) for i in range(2)]
    for k, batch in enumerate(batches):
      _assert_batches_equal(batch, {key: np.concatenate([per_host[0][k][key],
                                                         per_host[1][k][key]])
                                    for key in batch})


class SyntheticTest(absltest.TestCase):

  def test_default_is_a_thousand_class_cold_start_that_is_learnable(self):
    ds = data.get_dataset("synthetic")
    self.assertEqual((ds.num_classes, ds.image_shape, ds.num_train, ds.num_eval),
                     (1000, (8, 8, 1), 50_000, 10_000))
    np.testing.assert_array_equal(np.bincount(ds.train_labels), np.full(1000, 50))
    self.assertAlmostEqual(float(ds.train_images.std()), 1.0, delta=0.02)
    # Cold start: a fresh linear softmax policy with small weights gives p ~ 1/C.
    rng = np.random.default_rng(0)
    logits = ds.eval_images.reshape(-1, 64) @ (0.01 * rng.standard_normal((64, 1000)))
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    p_true = np.exp(log_p[np.arange(ds.num_eval), ds.eval_labels])
    self.assertAlmostEqual(float(p_true.mean()) * 1000, 1.0, delta=0.05)
    # Learnable: class means of the training set classify held-out examples.
    means = np.stack([ds.train_images[ds.train_labels == c].reshape(-1, 64).mean(0)
                      for c in range(1000)])
    eval_flat = ds.eval_images.reshape(-1, 64)
    distances = (means**2).sum(-1) - 2 * eval_flat @ means.T
    self.assertGreater(float(np.mean(distances.argmin(-1) == ds.eval_labels)), 0.9)

  def test_configurable_and_seeded(self):
    ds = data.synthetic(num_classes=7, num_train=70, num_eval=14, image_shape=(64,),
                        noise=0.5, seed=3)
    self.assertEqual((ds.num_classes, ds.image_shape, ds.num_train), (7, (64,), 70))
    _assert_batches_equal(ds.train_batch(4, 10, seed=1),
                          data.synthetic(num_classes=7, num_train=70, num_eval=14,
                                         image_shape=(64,), noise=0.5, seed=3)
                          .train_batch(4, 10, seed=1))
    with self.assertRaisesRegex(ValueError, "noise must be > 0"):
      data.synthetic(noise=0.0)


@pytest.fixture(scope="module")
def tiny_tfds_dir(tmp_path_factory) -> str:
  """A small prepared tfds dataset of PNG grayscale images of varying size."""
  _, tfds = tensorflow_and_tfds()

  class SeraTinyImages(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          "image": tfds.features.Image(shape=(None, None, 1), encoding_format="png"),
          "label": tfds.features.ClassLabel(num_classes=4)}))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {"train": self._generate_examples(0, 30), "test": self._generate_examples(1, 9)}

    def _generate_examples(self, seed, count):
      rng = np.random.default_rng(seed)
      for i in range(count):
        height, width = rng.integers(12, 40, size=2)
        yield i, {"image": rng.integers(0, 256, (height, width, 1), dtype=np.uint8),
                  "label": i % 4}

  data_dir = os.fspath(tmp_path_factory.mktemp("tfds"))
  SeraTinyImages(data_dir=data_dir).download_and_prepare()
  return data_dir


def test_unprepared_imagenet_data_dir_says_where_files_go_and_how_to_build(tmp_path):
  data_dir = os.fspath(tmp_path / "image net")  # a space: the command quotes the paths
  with pytest.raises(FileNotFoundError) as raised:
    data.get_dataset("imagenet2012", data_dir=data_dir)
  message = str(raised.value)
  manual_dir = os.path.join(data_dir, "downloads", "manual")
  assert f"into {manual_dir}/" in message
  assert "ILSVRC2012_img_train.tar" in message
  assert "ILSVRC2012_img_val.tar" in message
  command = message.rpartition("\n")[2].strip()
  assert shlex.split(command) == ["tfds", "build", "imagenet2012", f"--data_dir={data_dir}",
                                  f"--manual_dir={manual_dir}"]


def test_imagenet_pipeline_under_mock_data(tmp_path):
  _, tfds = tensorflow_and_tfds()
  data_dir = os.fspath(tmp_path)
  with tfds.testing.mock_data(num_examples=12):
    ds = data.get_dataset("tfds:imagenet2012", data_dir=data_dir)
    assert (ds.num_classes, ds.image_shape) == (1000, (224, 224, 3))
    batches = [ds.train_batch(step, 4, seed=5) for step in range(4)]  # Crosses an epoch.
    for batch in batches:
      assert batch["image"].shape == (4, 224, 224, 3)
      assert batch["image"].dtype == np.float32
      assert batch["label"].dtype == np.int32
      assert np.all((batch["label"] >= 0) & (batch["label"] < 1000))
      assert np.all(np.isfinite(batch["image"]))
    # Normalised by the ImageNet mean/std: uniform random pixels give about
    # (0.5 - mean) / std per channel.
    expected = (0.5 - np.array(data.IMAGENET_MEAN)) / np.array(data.IMAGENET_STD)
    np.testing.assert_allclose(batches[0]["image"].mean((0, 1, 2)), expected, atol=0.3)
    # A resumed run (a fresh pipeline) reads the same batch at the same step.
    resumed = data.imagenet2012(data_dir=data_dir).train_batch(2, 4, seed=5)
    _assert_batches_equal(resumed, batches[2])
    evals = list(ds.eval_batches(8))
    assert [int(b["mask"].sum()) for b in evals] == [8, 4]
    assert evals[-1]["image"].shape == (8, 224, 224, 3)


def test_prepared_local_dataset_shards_hosts_and_resumes(tiny_tfds_dir):
  ds = data.get_dataset("tfds:sera_tiny_images", data_dir=tiny_tfds_dir, image_size=16,
                        train_augmentation="random_resized_crop",
                        eval_preprocessing="center_crop")
  assert (ds.num_classes, ds.image_shape, ds.num_train, ds.num_eval) == (4, (16, 16, 1), 30, 9)
  assert ds.steps_per_epoch(4) == 7
  steps = [ds.train_batch(step, 4, seed=0) for step in range(9)]
  labels = np.concatenate([b["label"] for b in steps[:7]])
  assert np.bincount(labels).max() <= 8  # One epoch: no example twice (labels are i % 4).
  fresh = data.tfds_images("sera_tiny_images", data_dir=tiny_tfds_dir, image_size=16,
                           train_augmentation="random_resized_crop")
  for step in (8, 3):  # Out of order: each call rebuilds the epoch and skips.
    _assert_batches_equal(fresh.train_batch(step, 4, seed=0), steps[step])
  hosts = [ds.train_batch(0, 4, seed=0, process_index=i, process_count=2) for i in range(2)]
  assert hosts[0]["image"].shape == (2, 16, 16, 1)
  evals = [list(ds.eval_batches(4, process_index=i, process_count=2)) for i in range(2)]
  assert len(evals[0]) == len(evals[1])  # Hosts stay in step.
  assert sum(int(b["mask"].sum()) for e in evals for b in e) == 9


def test_unknown_dataset_name_is_rejected():
  with pytest.raises(ValueError, match="unknown dataset 'cifar'"):
    data.get_dataset("cifar")


def test_digits_validation_split_comes_out_of_the_training_images():
  plain = data.get_dataset("digits")
  split = data.get_dataset("digits", num_validation=300)
  assert (plain.num_validation, split.num_validation) == (0, 300)
  assert (split.num_train, split.num_eval) == (plain.num_train - 300, plain.num_eval)
  # The same held-out images (standardised by the smaller training set's statistics).
  np.testing.assert_array_equal(split.eval_labels, plain.eval_labels)
  correlation = np.corrcoef(split.eval_images.ravel(), plain.eval_images.ravel())[0, 1]
  assert correlation == pytest.approx(1.0, abs=1e-6)
  rows = lambda images: {image.tobytes() for image in images}  # noqa: E731
  assert len(rows(split.validation_images) | rows(split.train_images)) == len(
      rows(plain.train_images))
  assert not rows(split.validation_images) & rows(split.train_images)
  assert not rows(split.validation_images) & rows(split.eval_images)
  with pytest.raises(ValueError, match="num_eval \\+ num_validation"):
    data.get_dataset("digits", num_validation=1437)


def test_synthetic_validation_split_is_fresh_noise_and_changes_no_other_split():
  kwargs = dict(num_classes=10, num_train=200, num_eval=100)
  plain = data.get_dataset("synthetic", **kwargs)
  split = data.get_dataset("synthetic", num_validation=50, **kwargs)
  for name in ("train_images", "train_labels", "eval_images", "eval_labels"):
    np.testing.assert_array_equal(getattr(split, name), getattr(plain, name))
  assert split.validation_images.shape == (50, 8, 8, 1)
  assert np.bincount(split.validation_labels).tolist() == [5] * 10
  assert not np.isin(split.validation_images[:, 0, 0, 0], split.eval_images[:, 0, 0, 0]).any()


def test_the_validation_split_stands_in_for_the_held_out_one():
  dataset = data.get_dataset("synthetic", num_classes=10, num_train=200, num_eval=100,
                             num_validation=30)
  validation = dataset.validation_split()
  assert validation.num_eval == 30
  np.testing.assert_array_equal(validation.eval_labels, dataset.validation_labels)
  with pytest.raises(ValueError, match="no validation split; give it dataset_kwargs"):
    data.get_dataset("digits").validation_split()
