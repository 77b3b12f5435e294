"""The maze warm start: supervised imitation of BFS paths on a pool disjoint from RL and eval.

As the paper's authors make it: `config.num_sft_mazes` mazes of the pool
(`sera_jax.settings.maze.sets`), each seen once, `config.sft_batch_size` a step, minimising the
mean negative log-likelihood of their shortest paths with Adam on a cosine decay from
`config.sft_learning_rate` to 0 (gradients clipped at `GRAD_CLIP_NORM`, the authors'), from fresh
parameters of `config.sft_seed`.

The warm start depends on the data and the policy alone, never on a run's seed or method: it
is made once and every run of a figure starts from it, so seeds differ in RL randomness only.
`warm_start` keeps it in the process (each run of a figure) and, with a `directory`, on disk
under a fingerprint of the config keys it depends on (the runs of another process, or a
figure resumed after a kill).
"""

import hashlib
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm

from sera_jax.common import files
from sera_jax.settings.maze.policy import MazePolicy

# The config keys a warm start depends on: the maze sets (the pool avoids the others), the
# policy and the recipe.
KEYS = ("data_seed", "maze_size", "max_steps", "num_train_mazes", "num_eval_mazes",
        "num_validation_mazes", "num_sft_mazes", "sft_disjoint_paths", "sft_batch_size",
        "sft_learning_rate", "sft_seed", "dim", "num_layers", "num_heads")
GRAD_CLIP_NORM = 1.0  # the warm start's own, so runs of any RL clip share one
_IN_PROCESS: dict[str, dict] = {}


def fingerprint(config: ml_collections.ConfigDict) -> str:
  """A short hash of the config values of `KEYS`: equal warm starts, equal fingerprints."""
  values = json.dumps({key: config[key] for key in KEYS}, sort_keys=True)
  return hashlib.sha256(values.encode()).hexdigest()[:16]


def params_digest(params) -> str:
  """A hash of the parameters' bytes: a warm start made again in another process (or
  session) is the same one when its digest is."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(jax.device_get(params)):
    digest.update(np.ascontiguousarray(leaf).tobytes())
  return digest.hexdigest()[:16]


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Clipped Adam on a cosine decay from config.sft_learning_rate to 0 over the pool."""
  steps = max(config.num_sft_mazes // config.sft_batch_size, 1)  # 0 mazes: no step taken
  return optax.chain(optax.clip_by_global_norm(GRAD_CLIP_NORM),
                     optax.adam(optax.cosine_decay_schedule(config.sft_learning_rate, steps)))


def train(policy: MazePolicy, mazes: np.ndarray, paths: np.ndarray,
          config: ml_collections.ConfigDict, *, progress: bool = True) -> dict:
  """The warm start's parameters: one pass over the pool (`mazes` with their `paths`) in
  batches of config.sft_batch_size, in the pool's order (its mazes are i.i.d. draws)."""
  optimizer = make_optimizer(config)
  params = policy.init(jax.random.PRNGKey(config.sft_seed))
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, mazes, paths):
    nll = lambda p: -jnp.mean(policy.log_prob(p, mazes, paths[:, None])[:, 0])  # noqa: E731
    loss, grads = jax.value_and_grad(nll)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batch = config.sft_batch_size
  bar = tqdm.trange(len(mazes) // batch, desc="warm start", unit="step", disable=not progress)
  for i in bar:
    params, opt_state, loss = step(params, opt_state, mazes[i * batch:(i + 1) * batch],
                                   paths[i * batch:(i + 1) * batch])
    if i % 50 == 0:
      bar.set_postfix(nll=f"{float(loss):.3f}")
  return params


def warm_start(policy: MazePolicy, mazes: np.ndarray, paths: np.ndarray,
               config: ml_collections.ConfigDict, directory: str = "") -> dict:
  """The warm start of `config` (see the module docstring): made once a process, and read
  from (or saved to) `directory`/<fingerprint> when a directory is given."""
  key = fingerprint(config)
  if key in _IN_PROCESS:
    return _IN_PROCESS[key]
  path = files.path(directory) / key if directory else None
  if path is not None and path.exists():
    template = policy.init(jax.random.PRNGKey(config.sft_seed))
    with ocp.StandardCheckpointer() as checkpointer:
      params = checkpointer.restore(path, template)
  else:
    params = train(policy, mazes, paths, config)
    if path is not None:
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, params)
  _IN_PROCESS[key] = params
  return params
