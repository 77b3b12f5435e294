"""Tests for sera_jax.models: shapes, purity and VJP/vmap behaviour of the functional wrapper."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

from sera_jax.common import models
from sera_jax.common.models import conv

# Small configurations that compile in a few seconds on two CPU cores.
_TINY = {
    "mlp": dict(name="mlp", input_shape=(8, 8, 1), hidden_sizes=(16,)),
    "small_cnn": dict(name="small_cnn", input_shape=(8, 8, 1), channels=(4, 8)),
    "small_cnn_bn": dict(name="small_cnn", input_shape=(8, 8, 1), channels=(4, 8),
                         batch_norm=True),
    "resnet18_small": dict(name="resnet18", input_shape=(8, 8, 1), small_inputs=True, width=4),
    # The ImageNet stem (7x7/2 conv + max-pool), computing in bfloat16.
    "resnet18_stem": dict(name="resnet18", input_shape=(32, 32, 3), width=4,
                          dtype=jnp.bfloat16),
}


@functools.cache
def _tiny_model(config: str) -> models.FunctionalModel:
  return models.create_model(num_classes=5, **_TINY[config])


@functools.cache
def _initial(config: str) -> tuple[dict, dict]:
  return _tiny_model(config).init(0)


def _images(model: models.FunctionalModel, batch: int = 4, seed: int = 0) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), (batch, *model.input_shape))


def _num_params(model: models.FunctionalModel) -> int:
  abstract = jax.eval_shape(model.init)
  return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract[0]))


@pytest.mark.slow
class ShapeTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(name, name) for name in _TINY])
  def test_logits_shape_dtype_and_batch_stats(self, config):
    model = _tiny_model(config)
    params, batch_stats = _initial(config)
    chex.assert_type(jax.tree.leaves(params), jnp.float32)
    logits, new_stats = jax.jit(model.apply, static_argnames="train")(
        params, batch_stats, _images(model), train=True)
    chex.assert_shape(logits, (4, 5))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)
    has_bn = config not in ("mlp", "small_cnn")
    self.assertEqual(bool(jax.tree.leaves(batch_stats)), has_bn)
    chex.assert_trees_all_equal_shapes(new_stats, batch_stats)

  def test_params_are_pure_dicts_with_string_keys(self):
    params, batch_stats = _initial("resnet18_small")
    for tree in (params, batch_stats):
      paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
      for path in paths:
        self.assertTrue(all(isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)
                            for k in path), path)
      self.assertIs(type(tree), dict)

  def test_resnet50_tiny_input(self):
    model = models.create_model("resnet50", num_classes=7, input_shape=(32, 32, 3), width=8)
    params, batch_stats = model.init(1)
    images = _images(model, batch=2)
    logits, new_stats = jax.jit(model.apply, static_argnames="train")(
        params, batch_stats, images, train=True)
    chex.assert_shape(logits, (2, 7))
    chex.assert_tree_all_finite(logits)
    # The last block outputs 8 * 8 * 4 = 256 channels into the head.
    chex.assert_shape(params["head"]["kernel"], (256, 7))
    chex.assert_trees_all_equal_shapes(new_stats, batch_stats)

  @parameterized.parameters(("resnet18", 11_689_512), ("resnet50", 25_557_032))
  def test_imagenet_parameter_counts_match_the_reference_architectures(self, name, expected):
    # Published parameter counts of ResNet-18/50 (1000 classes, 224x224 inputs);
    # only shapes are evaluated, nothing is allocated.
    model = models.create_model(name, num_classes=1000, input_shape=(224, 224, 3))
    self.assertEqual(_num_params(model), expected)


class PurityTest(parameterized.TestCase):

  def test_init_is_deterministic_in_the_seed(self):
    model = _tiny_model("small_cnn_bn")
    chex.assert_trees_all_equal(model.init(3), model.init(3))
    first, _ = model.init(3)
    second, _ = model.init(4)
    self.assertFalse(np.array_equal(first["head"]["kernel"], second["head"]["kernel"]))

  @chex.variants(with_jit=True, without_jit=True)
  def test_apply_is_pure_and_updates_batch_stats_only_in_training(self):
    model = _tiny_model("small_cnn_bn")
    params, batch_stats = _initial("small_cnn_bn")
    images = _images(model)
    params_copy, stats_copy = jax.tree.map(np.array, (params, batch_stats))
    apply = self.variant(model.apply, static_argnames="train")

    train_a = apply(params, batch_stats, images, train=True)
    train_b = apply(params, batch_stats, images, train=True)
    eval_a = apply(params, batch_stats, images, train=False)
    eval_b = apply(params, batch_stats, images, train=False)

    chex.assert_trees_all_equal(train_a, train_b)
    chex.assert_trees_all_equal(eval_a, eval_b)
    # The inputs were not mutated.
    chex.assert_trees_all_equal((params, batch_stats), (params_copy, stats_copy))
    # Evaluation returns the running statistics unchanged; training moves them.
    chex.assert_trees_all_equal(eval_a[1], batch_stats)
    changed = jax.tree.map(lambda a, b: not np.allclose(a, b), train_a[1], batch_stats)
    self.assertTrue(all(jax.tree.leaves(changed)))
    # Batch statistics differ from the initial running ones, so the logits do too.
    self.assertFalse(np.allclose(train_a[0], eval_a[0]))

  def test_running_statistics_follow_the_batchnorm_momentum(self):
    model = _tiny_model("small_cnn_bn")
    params, batch_stats = _initial("small_cnn_bn")
    images = _images(model)
    _, new_stats = jax.jit(model.apply, static_argnames="train")(
        params, batch_stats, images, train=True)
    # First layer: mean of the conv output over batch and space, momentum 0.9.
    conv = nnx.Conv(1, 4, (3, 3), use_bias=False, rngs=nnx.Rngs(0))
    conv.kernel[...] = params["conv0"]["kernel"]
    expected_mean = 0.1 * jnp.mean(conv(images), axis=(0, 1, 2))
    np.testing.assert_allclose(new_stats["bn0"]["mean"], expected_mean, rtol=1e-5, atol=1e-6)

  def test_wrong_input_shape_is_rejected(self):
    model = _tiny_model("mlp")
    params, batch_stats = _initial("mlp")
    with self.assertRaisesRegex(ValueError, r"expects inputs of shape \[B, 8, 8, 1\]"):
      model.apply(params, batch_stats, jnp.zeros((2, 64)), train=False)

  def test_unknown_model_name_is_rejected(self):
    with self.assertRaisesRegex(ValueError, "model name must be one of"):
      models.create_model("vgg", num_classes=10, input_shape=(8, 8, 1))


class VjpTest(parameterized.TestCase):

  @parameterized.parameters("mlp", "small_cnn_bn")
  def test_vmapped_vjp_equals_separate_vjps_under_jit(self, config):
    model = _tiny_model(config)
    params, batch_stats = _initial(config)
    images = _images(model)
    cotangents = jax.random.normal(jax.random.key(1), (3, 4, 5))

    @jax.jit
    def stacked(params, batch_stats, images, cotangents):
      def forward(p):
        return model.apply(p, batch_stats, images, train=True)
      logits, vjp_fn, new_stats = jax.vjp(forward, params, has_aux=True)
      (grads,) = jax.vmap(vjp_fn)(cotangents)
      return logits, grads, new_stats

    @jax.jit
    def single(params, batch_stats, images, cotangent):
      def forward(p):
        return model.apply(p, batch_stats, images, train=True)
      _, vjp_fn, _ = jax.vjp(forward, params, has_aux=True)
      return vjp_fn(cotangent)[0]

    logits, grads, new_stats = stacked(params, batch_stats, images, cotangents)
    expected_logits, expected_stats = model.apply(params, batch_stats, images, train=True)
    chex.assert_trees_all_close(logits, expected_logits, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_stats, expected_stats, rtol=1e-5, atol=1e-6)
    for k in range(3):
      expected = single(params, batch_stats, images, cotangents[k])
      chex.assert_trees_all_close(jax.tree.map(lambda g, k=k: g[k], grads), expected,
                                  rtol=1e-5, atol=1e-6)



def _xla_convolution(images, kernel):
  return jax.lax.conv_general_dilated(images, kernel, (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _sliced_convolution(images, kernel):
  return conv.conv_general_dilated(images, kernel, (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _loss_and_gradients(convolution):
  """(images, kernel) -> (a loss, its gradients in both): one run's forward and backward."""
  def loss(images, kernel):
    return jnp.sum(jnp.sin(convolution(images, kernel)))
  return jax.value_and_grad(loss, argnums=(0, 1))


def _runs(num_runs=3):
  """Images [R, 2, 6, 6, 3] and kernels [R, 3, 3, 3, 4] of R runs."""
  images_key, kernel_key = jax.random.split(jax.random.key(0))
  return (jax.random.normal(images_key, (num_runs, 2, 6, 6, 3)),
          jax.random.normal(kernel_key, (num_runs, 3, 3, 3, 4)))


class SlicedConvolutionTest(chex.TestCase):
  """conv.conv_general_dilated: XLA's convolution, mapped over kernels without grouping on CPU."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_values_and_gradients_are_xlas_for_a_run_and_under_vmap(self):
    images, kernels = _runs()
    sliced = _loss_and_gradients(_sliced_convolution)
    # One run, and R runs over their own kernels (the grouping case) or one shared kernel.
    for way, arguments in (((None, None), (images[0], kernels[0])),
                           ((0, 0), (images, kernels)),
                           ((0, None), (images, kernels[0]))):
      mapped = sliced if way == (None, None) else jax.vmap(sliced, in_axes=way)
      got = self.variant(mapped)(*arguments)
      expected = [_loss_and_gradients(_xla_convolution)(
          images[r] if way[0] == 0 else arguments[0],
          kernels[r] if way[1] == 0 else arguments[1]) for r in range(len(images))]
      if way == (None, None):
        expected = expected[0]
      else:
        expected = jax.tree.map(lambda *runs: jnp.stack(runs), *expected)
      chex.assert_trees_all_close(got, expected, rtol=1e-6, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_cotangents_mapped_inside_runs_mapped_outside(self):
    # The alignment step's shape: several cotangents through one run's backward pass, vmapped
    # inside the step, and the step vmapped over the runs.
    images, kernels = _runs()

    def kernel_gradients(convolution, images, kernel):
      outputs, pullback = jax.vjp(lambda kernel: convolution(images, kernel), kernel)
      cotangents = jnp.stack([outputs * weight for weight in (1.0, -0.5, 2.0)])
      return jax.vmap(pullback)(cotangents)[0]

    got = self.variant(jax.vmap(functools.partial(kernel_gradients, _sliced_convolution)))(
        images, kernels)
    expected = jnp.stack([kernel_gradients(_xla_convolution, images[r], kernels[r])
                          for r in range(len(images))])
    chex.assert_shape(got, (3, 3, 3, 3, 3, 4))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

  @parameterized.parameters(("cpu", 0), ("cuda", 3), ("tpu", 3))
  def test_a_vmap_over_kernels_groups_its_convolutions_on_every_platform_but_the_cpu(
      self, platform, grouped):
    images, kernels = _runs(num_runs=5)
    step = jax.jit(jax.vmap(_loss_and_gradients(_sliced_convolution)))
    program = step.trace(images, kernels).lower(lowering_platforms=(platform,)).as_text()
    # Forward, images' gradient and kernel's gradient: grouped five ways, or five of each.
    self.assertEqual(program.count("feature_group_count = 5")
                     + program.count("batch_group_count = 5"), grouped)
    self.assertGreaterEqual(program.count("stablehlo.convolution"), 3 if grouped else 15)

  def test_the_models_convolve_with_it(self):
    for name in ("small_cnn", "resnet18_small"):
      module = nnx.eval_shape(lambda name=name: _tiny_model(name).build(nnx.Rngs(0)))
      convs = [node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.Conv)]
      self.assertNotEmpty(convs)
      for layer in convs:
        self.assertIs(layer.conv_general_dilated, conv.conv_general_dilated)


if __name__ == "__main__":
  pytest.main([__file__])
