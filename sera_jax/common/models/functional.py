"""A pure functional view of the NNX models for use inside jax.jit / jax.vjp.

docs/method.md#the-packages-layers (last rule): the differentiated function must be pure: pure-dict
parameters and batch statistics in, logits and the new batch statistics out.
`FunctionalModel.apply` merges the module from the state it is *given*, inside
whatever trace calls it, and splits the updated BatchNorm statistics back out,
so no module object ever crosses a trace boundary (a module merged from state
captured in an outer trace raises `TraceContextError` when BatchNorm writes).

Typical use with several logit cotangents pushed through one backward pass
(docs/method.md#classification-as-rl):

  model = create_model("resnet18", num_classes=10, input_shape=(32, 32, 3))
  params, batch_stats = model.init(0)
  forward = lambda p: model.apply(p, batch_stats, images, train=True)
  logits, vjp_fn, new_batch_stats = jax.vjp(forward, params, has_aux=True)
  (grads,) = jax.vmap(vjp_fn)(stacked_logit_cotangents)   # [k, ...] per leaf
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sera_jax.common.models.cnn import SmallCNN
from sera_jax.common.models.mlp import MLP
from sera_jax.common.models.resnet import resnet18, resnet50
from sera_jax.method import validation

PyTree = Any

# name -> constructor(input_shape, num_classes, *, rngs, **kwargs) -> module whose
# __call__(images, *, train) returns [B, C] logits.
MODEL_BUILDERS: dict[str, Callable[..., nnx.Module]] = {
    "mlp": MLP,
    "small_cnn": SmallCNN,
    "resnet18": resnet18,
    "resnet50": resnet50,
}


@dataclasses.dataclass(frozen=True, eq=False)
class FunctionalModel:
  """A model as two pure functions over pure-dict pytrees.

  Attributes:
    name: registry name of the architecture.
    num_classes: number of logits C.
    input_shape: shape of one example (without the batch axis).
    seed: default initialisation seed of `init`.
    graphdef: the static structure of the NNX module.
    build: constructor `build(rngs) -> nnx.Module` of that structure.
  """

  name: str
  num_classes: int
  input_shape: tuple[int, ...]
  seed: int
  graphdef: nnx.GraphDef
  build: Callable[[nnx.Rngs], nnx.Module]

  def init(self, seed_or_key: int | jax.Array | None = None) -> tuple[PyTree, PyTree]:
    """Initialises the model.

    Args:
      seed_or_key: an int seed (turned into an RBG key) or a JAX PRNG key;
        defaults to `self.seed`.

    Returns:
      (params, batch_stats): nested dicts of arrays with string keys
      (`nnx.Param` and `nnx.BatchStat` variables); batch_stats is {} for models
      without BatchNorm.
    """
    if seed_or_key is None:
      seed_or_key = self.seed
    if isinstance(seed_or_key, int | np.integer):
      # RBG keys: the XLA random-bit generator compiles ~5x faster than threefry
      # for the many differently shaped initialisers of a ResNet.
      key = jax.random.key(int(seed_or_key), impl="rbg")
    else:
      key = seed_or_key
    return self._jitted_init(key)

  @functools.cached_property
  def _jitted_init(self) -> Callable[[jax.Array], tuple[PyTree, PyTree]]:
    # One compiled program (cached per model) instead of one eager dispatch per
    # parameter tensor.
    def initial_state(key):
      _, params, batch_stats = nnx.split(self.build(nnx.Rngs(key)), nnx.Param, nnx.BatchStat)
      return nnx.to_pure_dict(params), nnx.to_pure_dict(batch_stats)
    return jax.jit(initial_state)

  def apply(self, params: PyTree, batch_stats: PyTree, images: jax.Array, *,
            train: bool) -> tuple[jax.Array, PyTree]:
    """Runs the network; pure, so it can sit under jax.jit, jax.vjp and jax.vmap.

    Args:
      params: parameters from `init` (or any pytree of the same structure).
      batch_stats: BatchNorm running statistics from `init` or a previous apply.
      images: [B, *input_shape] inputs.
      train: True normalises with the statistics of this batch and returns
        updated running statistics; False uses the running statistics and
        returns `batch_stats` unchanged.

    Returns:
      (logits, new_batch_stats): float32 [B, C] logits and the batch statistics
      after this call.
    """
    images = jnp.asarray(images)
    if images.shape[1:] != self.input_shape:
      raise ValueError(
          f"{self.name} expects inputs of shape [B, {', '.join(map(str, self.input_shape))}]; "
          f"got {tuple(images.shape)}.")
    if not jnp.issubdtype(images.dtype, jnp.floating):
      images = images.astype(jnp.float32)
    # Merge from the arguments, inside the caller's trace (see module docstring).
    module = nnx.merge(self.graphdef, params, batch_stats)
    logits = module(images, train=train).astype(jnp.float32)
    if not train:
      return logits, batch_stats
    return logits, nnx.to_pure_dict(nnx.state(module, nnx.BatchStat))


def create_model(name: str, *, num_classes: int, input_shape: Sequence[int], seed: int = 0,
                 **kwargs) -> FunctionalModel:
  """Builds a `FunctionalModel` from the registry `MODEL_BUILDERS`.

  Args:
    name: one of "mlp", "small_cnn", "resnet18", "resnet50".
    num_classes: number of output logits C (>= 2).
    input_shape: shape of one example, e.g. (8, 8, 1) or (224, 224, 3).
    seed: default seed of `FunctionalModel.init`.
    **kwargs: architecture options passed to the constructor (e.g.
      hidden_sizes for "mlp"; small_inputs, width, dtype for the ResNets).

  Returns:
    The functional model; no parameters are allocated until `init`.
  """
  validation.choice("model name", name, tuple(MODEL_BUILDERS))
  num_classes = validation.integer("num_classes", num_classes, minimum=2)
  input_shape = tuple(validation.integer("input_shape entry", d, minimum=1)
                      for d in input_shape)
  seed = validation.integer("seed", seed, minimum=0)
  build = functools.partial(_build, MODEL_BUILDERS[name], input_shape, num_classes, kwargs)
  # Abstract construction: the graph structure without allocating parameters.
  graphdef, _, _, rest = nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))),
                                   nnx.Param, nnx.BatchStat, ...)
  if jax.tree.leaves(rest):
    raise TypeError(f"model {name!r} holds state other than Param and BatchStat: "
                    f"{jax.tree.map(jnp.shape, rest)}; FunctionalModel cannot carry it.")
  return FunctionalModel(name=name, num_classes=num_classes, input_shape=input_shape,
                         seed=seed, graphdef=graphdef, build=build)


def _build(constructor, input_shape, num_classes, kwargs, rngs: nnx.Rngs) -> nnx.Module:
  return constructor(input_shape, num_classes, rngs=rngs, **kwargs)
