"""Grid mazes in pure JAX: randomized Prim generation, rollouts, BFS solutions.

A maze of odd `size` is a bool grid [size, size], True where a cell is open.
Cells of the underlying graph sit at odd coordinates (2i + 1, 2j + 1); the
grid squares between two cells are walls that Prim's algorithm carves. Every
generated maze is perfect: its open squares form a tree (connected, no cycle).
The walker starts at (1, 1) and must reach the goal (size - 2, size - 2).

Actions are UP, DOWN, LEFT, RIGHT and DONE. A rollout is a fixed-length action
sequence [T] (T is the step limit). Its episode ends at the first action that

* lands on the goal: success;
* moves into a wall or off the grid: failure;
* is DONE (giving up): failure;

and a rollout whose T actions contain none of these fails (step limit). So
DONE is never needed to succeed: reaching the goal ends the episode at once.
Actions after the end are not part of the rollout: the policy does not score
them (`episode_mask`), and the sampler and `shortest_path` pad with DONE.

Everything is keyed, jittable and vmappable, with static shapes (`size` and
the step limit are static Python ints).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sera_jax.method import validation

UP, DOWN, LEFT, RIGHT, DONE = range(5)
NUM_ACTIONS = 5
# (row, column) displacement of each action; DONE stays put.
MOVES = np.array([[-1, 0], [1, 0], [0, -1], [0, 1], [0, 0]], dtype=np.int32)
_UNREACHABLE = jnp.iinfo(jnp.int32).max // 2


def check_size(size: int) -> int:
  """Returns `size` after checking it is an odd int >= 5."""
  size = validation.integer("size", size, minimum=5)
  if size % 2 == 0:
    raise ValueError(f"size must be odd (cells at odd coordinates); got {size}.")
  return size


def start(size: int) -> jax.Array:
  """The start square (1, 1)."""
  del size
  return jnp.array([1, 1], dtype=jnp.int32)


def goal(size: int) -> jax.Array:
  """The goal square (size - 2, size - 2)."""
  return jnp.array([size - 2, size - 2], dtype=jnp.int32)


def max_path_length(size: int) -> int:
  """The longest possible shortest path: a perfect maze has 2 c^2 - 1 open squares,
  c = (size - 1) / 2 cells per side, so a path has at most 2 c^2 - 2 moves."""
  cells = (check_size(size) - 1) // 2
  return 2 * cells * cells - 2


def _neighbour_values(values: jax.Array, fill) -> jax.Array:
  """values[r + dr, c + dc] for the four moves, [size, size, 4], `fill` off the grid."""
  size = values.shape[0]
  padded = jnp.pad(values, 1, constant_values=fill)
  return jnp.stack(
      [padded[1 + dr:1 + dr + size, 1 + dc:1 + dc + size] for dr, dc in MOVES[:4].tolist()],
      axis=-1)


@functools.partial(jax.jit, static_argnames="size")
def generate(key: jax.Array, size: int = 9) -> jax.Array:
  """A random perfect maze by randomized Prim's algorithm.

  Starts from a uniformly random cell; at each of the c^2 - 1 iterations it
  carves a wall drawn uniformly among the walls between a visited and an
  unvisited cell (the frontier) and visits the new cell. This is the law of
  the textbook wall-list version, whose stale walls are simply skipped.

  Args:
    key: a PRNG key.
    size: odd side length >= 5 (static).

  Returns:
    bool [size, size], True on open squares.
  """
  size = check_size(size)
  cells = (size - 1) // 2
  start_key, loop_key = jax.random.split(key)
  first = jax.random.randint(start_key, (2,), 0, cells)
  visited = jnp.zeros((cells, cells), bool).at[first[0], first[1]].set(True)
  grid = jnp.zeros((size, size), bool).at[2 * first[0] + 1, 2 * first[1] + 1].set(True)

  def carve(iteration, carry):
    grid, visited = carry
    # Outside the cell grid counts as visited so that it is never a frontier.
    frontier = visited[..., None] & ~_neighbour_values(visited, True)  # [cells, cells, 4]
    logits = jnp.where(frontier, 0.0, -jnp.inf).reshape(-1)
    index = jax.random.categorical(jax.random.fold_in(loop_key, iteration), logits)
    row, col, action = jnp.unravel_index(index, frontier.shape)
    dr, dc = jnp.asarray(MOVES)[action]
    grid = grid.at[2 * row + 1 + dr, 2 * col + 1 + dc].set(True)
    grid = grid.at[2 * (row + dr) + 1, 2 * (col + dc) + 1].set(True)
    visited = visited.at[row + dr, col + dc].set(True)
    return grid, visited

  grid, _ = jax.lax.fori_loop(0, cells * cells - 1, carve, (grid, visited))
  return grid


def positions(actions: jax.Array, size: int) -> jax.Array:
  """Squares the walk lands on after each action, ignoring walls: [..., T, 2], unclipped."""
  return start(size) + jnp.cumsum(jnp.asarray(MOVES)[actions], axis=-2)


def outcome(maze: jax.Array, action: jax.Array, landing: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Whether `action`, landing on `landing` [..., 2], ends the episode and whether it succeeds.

  Args:
    maze: bool [size, size].
    action: int [...].
    landing: int [..., 2], the square the action moves to (unclipped).

  Returns:
    (ends bool [...], reaches_goal bool [...]).
  """
  size = maze.shape[0]
  inside = jnp.all((landing >= 0) & (landing < size), axis=-1)
  clipped = jnp.clip(landing, 0, size - 1)
  legal = inside & maze[clipped[..., 0], clipped[..., 1]]
  reaches_goal = jnp.all(landing == goal(size), axis=-1)
  return (action == DONE) | ~legal | reaches_goal, reaches_goal


def _walk(maze: jax.Array, actions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(in the episode [T], ends on the goal [T]) for one rollout."""
  validation.rank("maze", maze, 2)
  validation.rank("actions", actions, 1)
  ends, reaches_goal = outcome(maze, actions, positions(actions, maze.shape[0]))
  ended_before = jnp.cumsum(ends) - ends
  return ended_before == 0, reaches_goal


def episode_mask(maze: jax.Array, actions: jax.Array) -> jax.Array:
  """True on the actions of the episode: up to and including the one that ends it, bool [T]."""
  return _walk(maze, actions)[0]


def rollout_success(maze: jax.Array, actions: jax.Array) -> jax.Array:
  """Whether a rollout solves the maze (see the module docstring for the rule).

  Args:
    maze: bool [size, size] (open squares).
    actions: int [T]; T is the step limit.

  Returns:
    bool scalar. vmap it for batches.
  """
  in_episode, reaches_goal = _walk(maze, actions)
  return jnp.any(in_episode & reaches_goal)


def reward(maze: jax.Array, actions: jax.Array) -> jax.Array:
  """Binary reward, float32 1.0 on success and 0.0 otherwise."""
  return rollout_success(maze, actions).astype(jnp.float32)


def open_directions(maze: jax.Array) -> jax.Array:
  """Whether each of the four moves from a square lands on an open square, bool [size, size, 4]."""
  return _neighbour_values(maze, False)


def distances(maze: jax.Array) -> jax.Array:
  """BFS distance of every square to the goal (int32; a large value where unreachable).

  Bellman relaxation over the whole grid, size^2 rounds (a bound on any path).
  """
  size = maze.shape[0]
  initial = jnp.full(maze.shape, _UNREACHABLE, jnp.int32).at[size - 2, size - 2].set(0)

  def relax(_, dist):
    through_neighbour = jnp.min(_neighbour_values(dist, _UNREACHABLE), axis=-1) + 1
    return jnp.where(maze, jnp.minimum(dist, through_neighbour), _UNREACHABLE)

  return jax.lax.fori_loop(0, size * size, relax, jnp.where(maze, initial, _UNREACHABLE))


@functools.partial(jax.jit, static_argnames="max_steps")
def shortest_path(maze: jax.Array, max_steps: int) -> tuple[jax.Array, jax.Array]:
  """A shortest start-to-goal path as actions, for warm start and tests.

  Args:
    maze: bool [size, size] (a perfect maze has exactly one shortest path).
    max_steps: the step limit T (static).

  Returns:
    (actions int32 [T]: the moves, then DONE to the end; length int32: the
    number of moves). The path succeeds when length <= T.
  """
  dist = distances(maze)
  neighbour_dist = _neighbour_values(dist, _UNREACHABLE)
  size = maze.shape[0]

  def step(position, _):
    here = dist[position[0], position[1]]
    downhill = neighbour_dist[position[0], position[1]] == here - 1
    action = jnp.where(here == 0, DONE, jnp.argmax(downhill))
    return position + jnp.asarray(MOVES)[action], action

  _, actions = jax.lax.scan(step, start(size), None, length=max_steps)
  return actions, dist[1, 1]
