"""A small autoregressive maze policy: a prefix-LM transformer in flax NNX.

The sequence is the maze followed by the actions so far. Maze tokens are the
c x c cells of the maze (c = (size - 1) / 2), each embedded from its 4-bit
pattern of open directions and its (row, column); they attend to each other
only. Action token t embeds the previous action (BOS at t = 0), the step t and
the square the walk stands on after the previous actions — its coordinates and
its pattern of open directions. Those are deterministic functions of the maze
and the action prefix, so the policy is still pi(a_t | maze, a_<t); the
features only spare a small network from integrating moves itself. Action
tokens attend causally to the actions and fully to the maze. A rollout's
log-probability sums its episode's actions (`envs.maze.episode_mask`): actions
after the episode has ended are not scored, and the sampler pads them with DONE.

Maze keys and values do not depend on the actions, so they are computed once
per maze and shared by all its rollouts; sampling decodes one action per step
with a key/value cache. Rollouts are flat: rollout r belongs to maze
`maze_ids[r]`, so groups of unequal size share one static shape.

The API is pure (docs/method.md#the-packages-layers): parameters are a pure dict, and every function
merges graphdef and parameters inside itself.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from sera_jax.method import validation
from sera_jax.settings.maze import env as maze_env

_BOS = maze_env.NUM_ACTIONS


def _open_patterns(mazes: jax.Array) -> jax.Array:
  """4-bit pattern of the open moves from every square, int32 [M, size, size] in 0..15."""
  return jnp.sum(jax.vmap(maze_env.open_directions)(mazes) * 2 ** jnp.arange(4), axis=-1)


def _heads_first(x: jax.Array) -> jax.Array:
  """[..., T, H, D] -> [..., H, T, D], the layout attention's products read keys in."""
  return jnp.swapaxes(x, -3, -2)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax attention; q [..., Tq, H, D], k and v heads first [..., H, Tk, D], mask [Tq, Tk].

  Keys and values are kept heads first so that decoding, which attends to the whole cache
  at every step, does not transpose the cache at every step."""
  scores = jnp.einsum("...qhd,...hkd->...hqk", q, k) / jnp.sqrt(q.shape[-1])
  weights = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
  return jnp.einsum("...hqk,...hkd->...qhd", weights, v)


class _Block(nnx.Module):
  """Pre-norm transformer block whose attention keys are supplied by the caller."""

  def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.attention_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
    self.attention_out = nnx.Linear(dim, dim, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)

  def queries_keys_values(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[..., T, dim] -> three [..., T, heads, dim / heads]."""
    qkv = self.qkv(self.attention_norm(x))
    return tuple(part.reshape(*x.shape[:-1], self.num_heads, -1)
                 for part in jnp.split(qkv, 3, axis=-1))

  def finish(self, x: jax.Array, attended: jax.Array) -> jax.Array:
    """Residual attention output, then the residual MLP."""
    x = x + self.attention_out(attended.reshape(x.shape))
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class MazeTransformer(nnx.Module):
  """The network; use it through `MazePolicy`."""

  def __init__(self, size: int, max_steps: int, dim: int, num_layers: int, num_heads: int, *,
               rngs: nnx.Rngs):
    self.num_layers = num_layers
    self.max_steps = max_steps
    self.pattern_embed = nnx.Embed(16, dim, rngs=rngs)
    self.row_embed = nnx.Embed(size, dim, rngs=rngs)
    self.col_embed = nnx.Embed(size, dim, rngs=rngs)
    self.action_embed = nnx.Embed(maze_env.NUM_ACTIONS + 1, dim, rngs=rngs)
    self.step_embed = nnx.Embed(max_steps, dim, rngs=rngs)
    self.blocks = nnx.Dict({f"layer{i}": _Block(dim, num_heads, rngs=rngs)
                            for i in range(num_layers)})
    self.final_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, maze_env.NUM_ACTIONS, rngs=rngs)

  def _block(self, layer: int) -> _Block:
    return self.blocks[f"layer{layer}"]

  def _square_embedding(self, patterns: jax.Array, squares: jax.Array) -> jax.Array:
    """Embedding of squares [B, T, 2] of mazes whose patterns are [B, size, size]."""
    rows, cols = squares[..., 0], squares[..., 1]
    pattern = patterns[jnp.arange(patterns.shape[0])[:, None], rows, cols]
    return self.pattern_embed(pattern) + self.row_embed(rows) + self.col_embed(cols)

  def encode_mazes(self, mazes: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Per-layer keys and values of the maze tokens, each [M, heads, cells^2, head_dim]."""
    size = mazes.shape[-1]
    odd = jnp.arange(1, size, 2)
    cells = jnp.stack(jnp.meshgrid(odd, odd, indexing="ij"), axis=-1).reshape(-1, 2)
    patterns = _open_patterns(mazes)
    x = self._square_embedding(patterns, jnp.broadcast_to(cells, (mazes.shape[0],) + cells.shape))
    full = jnp.ones((cells.shape[0], cells.shape[0]), bool)
    keys_values = []
    for layer in range(self.num_layers):
      q, k, v = self._block(layer).queries_keys_values(x)
      k, v = _heads_first(k), _heads_first(v)
      keys_values.append((k, v))
      x = self._block(layer).finish(x, _attend(q, k, v, full))
    return keys_values

  def action_tokens(self, patterns: jax.Array, previous: jax.Array, squares: jax.Array,
                    steps: jax.Array) -> jax.Array:
    """Input tokens for predicting the actions at `steps`.

    Args:
      patterns: int [R, size, size], each rollout's maze patterns.
      previous: int [R, Tq], the action before each step (BOS at step 0).
      squares: int [R, Tq, 2], where the walk stands before each step (unclipped).
      steps: int [Tq].

    Returns:
      [R, Tq, dim].
    """
    squares = jnp.clip(squares, 0, patterns.shape[-1] - 1)
    return (self._square_embedding(patterns, squares) + self.action_embed(previous)
            + self.step_embed(steps))

  def action_logits(self, maze_keys_values, x: jax.Array, steps: jax.Array) -> jax.Array:
    """Logits [R, Tq, NUM_ACTIONS] of the actions at `steps` from their tokens x [R, Tq, dim],
    all T steps at once (teacher forcing): steps is arange(T), and maze_keys_values per layer
    (k, v), each [R, heads, cells^2, head_dim]."""
    for layer, (maze_k, maze_v) in enumerate(maze_keys_values):
      q, k, v = self._block(layer).queries_keys_values(x)
      causal = steps[None, :] <= steps[:, None]
      mask = jnp.concatenate([jnp.ones((steps.shape[0], maze_k.shape[-2]), bool), causal], axis=1)
      attended = _attend(q, jnp.concatenate([maze_k, _heads_first(k)], -2),
                         jnp.concatenate([maze_v, _heads_first(v)], -2), mask)
      x = self._block(layer).finish(x, attended)
    return self.head(self.final_norm(x))

  def start_cache(self, maze_keys_values) -> list[tuple[jax.Array, jax.Array]]:
    """The decoding cache: per layer (k, v), each [R, heads, cells^2 + T, head_dim], the
    maze's keys and values (`encode_mazes`, per rollout) and then T slots for the actions'."""
    def extended(maze):
      return jnp.concatenate(
          [maze, jnp.zeros((*maze.shape[:-2], self.max_steps, maze.shape[-1]), maze.dtype)], -2)
    return [(extended(k), extended(v)) for k, v in maze_keys_values]

  def decode_logits(self, cache, x: jax.Array, step: jax.Array
                    ) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
    """(Logits [R, NUM_ACTIONS], the cache with step's keys and values written) of the actions
    at `step` (a scalar) from their tokens x [R, dim] and the `start_cache` of the earlier steps."""
    new_cache = []
    x = x[:, None]
    for layer, (cache_k, cache_v) in enumerate(cache):
      q, k, v = self._block(layer).queries_keys_values(x)
      slot = cache_k.shape[-2] - self.max_steps + step
      cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, _heads_first(k), slot, axis=-2)
      cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, _heads_first(v), slot, axis=-2)
      new_cache.append((cache_k, cache_v))
      mask = (jnp.arange(cache_k.shape[-2]) <= slot)[None]
      x = self._block(layer).finish(x, _attend(q, cache_k, cache_v, mask))
    return self.head(self.final_norm(x))[:, 0], new_cache


@dataclasses.dataclass(frozen=True)
class MazePolicy:
  """Pure functional front end of `MazeTransformer`.

  Attributes:
    size: odd maze side length.
    max_steps: the step limit T (length of every action sequence).
    dim, num_layers, num_heads: transformer width, depth and heads.
  """
  size: int = 9
  max_steps: int = 31
  dim: int = 64
  num_layers: int = 2
  num_heads: int = 4

  def __post_init__(self):
    maze_env.check_size(self.size)
    validation.integer("max_steps", self.max_steps, minimum=1)
    validation.integer("num_layers", self.num_layers, minimum=1)
    validation.integer("num_heads", self.num_heads, minimum=1)
    if validation.integer("dim", self.dim, minimum=1) % self.num_heads:
      raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads}).")

  def _network(self, key: jax.Array) -> MazeTransformer:
    return MazeTransformer(self.size, self.max_steps, self.dim, self.num_layers, self.num_heads,
                           rngs=nnx.Rngs(params=key))

  @functools.cached_property
  def _graphdef(self):
    return nnx.split(nnx.eval_shape(lambda: self._network(jax.random.key(0))))[0]

  @functools.partial(jax.jit, static_argnums=0)
  def init(self, key: jax.Array) -> dict:
    """Fresh parameters as a pure dict, built under jit (eager construction is slow) and
    compiled once for equal policies (every run of a figure, every task of a batch)."""
    return nnx.to_pure_dict(nnx.state(self._network(key)))

  def num_params(self, params: dict) -> int:
    return sum(x.size for x in jax.tree.leaves(params))

  def _merge(self, params: dict) -> MazeTransformer:
    return nnx.merge(self._graphdef, params)

  def _check(self, mazes: jax.Array) -> None:
    chex.assert_rank(mazes, 3)
    chex.assert_axis_dimension(mazes, 1, self.size)
    chex.assert_axis_dimension(mazes, 2, self.size)

  def log_prob_rollouts(self, params: dict, mazes: jax.Array, maze_ids: jax.Array,
                        actions: jax.Array) -> jax.Array:
    """log pi(actions | maze) of flat rollouts, summed over the episode (`maze.episode_mask`).

    Args:
      params: parameters.
      mazes: bool [M, size, size].
      maze_ids: int [R], the maze of each rollout.
      actions: int [R, T].

    Returns:
      float32 [R].
    """
    self._check(mazes)
    chex.assert_shape(actions, (maze_ids.shape[0], self.max_steps))
    network = self._merge(params)
    maze_kv = [(k[maze_ids], v[maze_ids]) for k, v in network.encode_mazes(mazes)]
    steps = jnp.arange(self.max_steps)
    previous = jnp.concatenate([jnp.full_like(actions[:, :1], _BOS), actions[:, :-1]], axis=1)
    landings = maze_env.positions(actions, self.size)
    squares = jnp.concatenate(
        [jnp.broadcast_to(maze_env.start(self.size), landings[:, :1].shape), landings[:, :-1]], 1)
    tokens = network.action_tokens(_open_patterns(mazes)[maze_ids], previous, squares, steps)
    logits = network.action_logits(maze_kv, tokens, steps)
    chosen = jnp.take_along_axis(jax.nn.log_softmax(logits), actions[..., None], axis=-1)[..., 0]
    in_episode = jax.vmap(maze_env.episode_mask)(mazes[maze_ids], actions)
    return jnp.sum(jnp.where(in_episode, chosen, 0.0), axis=-1)

  def sample_rollouts(self, params: dict, mazes: jax.Array, maze_ids: jax.Array,
                      key: jax.Array, rollout_ids: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """Samples flat rollouts at temperature 1 with a key/value cache.

    After the episode ends the sequence is padded with DONE, which is not scored.
    Rollout r draws its step-t action from fold_in(fold_in(key, rollout_ids[r]), t),
    so sampling a buffer in chunks (with the chunks' ids) draws what sampling it
    at once does.

    Args:
      params: parameters.
      mazes: bool [M, size, size].
      maze_ids: int [R], the maze of each rollout.
      key: PRNG key.
      rollout_ids: int [R], each rollout's index in its buffer (default 0..R-1).

    Returns:
      (actions int32 [R, T], log-probabilities float32 [R]) with log-probabilities
      equal to `log_prob_rollouts` of the same actions.
    """
    self._check(mazes)
    network = self._merge(params)
    maze_kv = [(k[maze_ids], v[maze_ids]) for k, v in network.encode_mazes(mazes)]
    rollout_mazes = mazes[maze_ids]
    patterns = _open_patterns(rollout_mazes)
    rollouts = maze_ids.shape[0]
    rollout_ids = jnp.arange(rollouts) if rollout_ids is None else rollout_ids
    rollout_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rollout_ids)
    cache = network.start_cache(maze_kv)

    def decode(carry, step):
      previous, square, ended, log_prob, cache = carry
      tokens = network.action_tokens(patterns, previous[:, None], square[:, None], step[None])
      logits, cache = network.decode_logits(cache, tokens[:, 0], step)
      log_probs = jax.nn.log_softmax(logits)
      step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(rollout_keys, step)
      drawn = jax.vmap(jax.random.categorical)(step_keys, log_probs)
      action = jnp.where(ended, maze_env.DONE, drawn)
      chosen = jnp.take_along_axis(log_probs, action[:, None], axis=1)[:, 0]
      log_prob = log_prob + jnp.where(ended, 0.0, chosen)
      square = square + jnp.asarray(maze_env.MOVES)[action]
      ends, _ = jax.vmap(maze_env.outcome)(rollout_mazes, action, square)
      return (action, square, ended | ends, log_prob, cache), action

    start = jnp.broadcast_to(maze_env.start(self.size), (rollouts, 2))
    initial = (jnp.full(rollouts, _BOS, jnp.int32), start,
               jnp.zeros(rollouts, bool), jnp.zeros(rollouts), cache)
    (_, _, _, log_prob, _), actions = jax.lax.scan(decode, initial, jnp.arange(self.max_steps))
    return actions.T.astype(jnp.int32), log_prob

  def sample(self, params: dict, mazes: jax.Array, key: jax.Array,
             num_samples: int) -> tuple[jax.Array, jax.Array]:
    """num_samples rollouts per maze: (actions int32 [M, N, T], log-probabilities [M, N])."""
    num_mazes = mazes.shape[0]
    maze_ids = jnp.repeat(jnp.arange(num_mazes), num_samples)
    actions, log_prob = self.sample_rollouts(params, mazes, maze_ids, key)
    return (actions.reshape(num_mazes, num_samples, self.max_steps),
            log_prob.reshape(num_mazes, num_samples))

  def log_prob(self, params: dict, mazes: jax.Array, actions: jax.Array) -> jax.Array:
    """log pi of actions [M, N, T] (scored over each episode) -> [M, N]."""
    num_mazes, num_samples = actions.shape[:2]
    maze_ids = jnp.repeat(jnp.arange(num_mazes), num_samples)
    flat = self.log_prob_rollouts(params, mazes, maze_ids, actions.reshape(-1, self.max_steps))
    return flat.reshape(num_mazes, num_samples)
