"""Tests of the maze environment and the maze policy."""

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sera_jax.settings.maze import env as maze
from sera_jax.settings.maze.policy import MazePolicy


def _mazes(size, count, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), count)
  return np.asarray(jax.vmap(lambda key: maze.generate(key, size))(keys))


def _reference_distances(grid, source):
  """Independent BFS: {square: distance from source} over the squares it reaches."""
  queue, distance = collections.deque([source]), {source: 0}
  while queue:
    r, c = queue.popleft()
    for dr, dc in maze.MOVES[:4]:
      nxt = (r + dr, c + dc)
      if 0 <= nxt[0] < grid.shape[0] and 0 <= nxt[1] < grid.shape[1] and grid[nxt] and (
          nxt not in distance):
        distance[nxt] = distance[(r, c)] + 1
        queue.append(nxt)
  return distance


def _reference_success(grid, actions):
  """Step-by-step simulator of the rule in the module docstring of sera_jax.settings.maze.env."""
  size = grid.shape[0]
  r, c = 1, 1
  for action in actions:
    if action == maze.DONE:
      return False
    r, c = r + maze.MOVES[action][0], c + maze.MOVES[action][1]
    if not (0 <= r < size and 0 <= c < size and grid[r, c]):
      return False
    if (r, c) == (size - 2, size - 2):
      return True
  return False


@pytest.mark.parametrize("size", [5, 9, 17])
def test_generated_mazes_are_perfect(size):
  cells = (size - 1) // 2
  for grid in _mazes(size, 32, seed=size):
    open_squares = list(zip(*np.nonzero(grid), strict=True))
    edges = np.sum(grid[1:] & grid[:-1]) + np.sum(grid[:, 1:] & grid[:, :-1])
    assert len(open_squares) == 2 * cells * cells - 1
    assert edges == len(open_squares) - 1  # a connected graph with |V| - 1 edges is a tree
    assert set(_reference_distances(grid, (1, 1))) == set(open_squares)  # all connected
    assert grid[1, 1] and grid[size - 2, size - 2]
    assert not grid[0].any() and not grid[-1].any() and not grid[:, 0].any() and (
        not grid[:, -1].any())


def test_generation_is_keyed_and_varied():
  a = maze.generate(jax.random.PRNGKey(3), 9)
  np.testing.assert_array_equal(a, maze.generate(jax.random.PRNGKey(3), 9))
  assert len({m.tobytes() for m in _mazes(9, 32)}) > 16


def test_bad_size_is_rejected():
  with pytest.raises(ValueError, match="odd"):
    maze.generate(jax.random.PRNGKey(0), 8)
  with pytest.raises(ValueError, match=">= 5"):
    maze.generate(jax.random.PRNGKey(0), 3)


@pytest.mark.slow
@pytest.mark.parametrize("size", [9, 17])
def test_shortest_paths_succeed_and_are_shortest(size):
  max_steps = maze.max_path_length(size) + 1
  grids = _mazes(size, 16, seed=1)
  actions, lengths = jax.vmap(lambda g: maze.shortest_path(g, max_steps))(jnp.asarray(grids))
  successes = jax.vmap(maze.rollout_success)(jnp.asarray(grids), actions)
  assert bool(jnp.all(successes))
  for grid, path, length in zip(grids, np.asarray(actions), np.asarray(lengths), strict=True):
    assert length == _reference_distances(grid, (1, 1))[(size - 2, size - 2)]
    assert np.all(path[:length] < maze.DONE) and np.all(path[length:] == maze.DONE)
    assert _reference_success(grid, path)


def test_walks_into_walls_fail():
  grid = jnp.asarray(_mazes(9, 1)[0])
  path, length = maze.shortest_path(grid, 31)
  path = np.asarray(path)
  for t in range(int(length)):
    here = np.array([1, 1]) + maze.MOVES[path[:t]].sum(axis=0)
    for action in range(4):
      there = here + maze.MOVES[action]
      if not grid[there[0], there[1]]:
        bumped = path.copy()
        bumped[t] = action  # a wall on the way; the rest of the shortest path is kept
        assert not bool(maze.rollout_success(grid, jnp.asarray(bumped)))
  # The border: start (1, 1) has walls above and to the left.
  for first in (maze.UP, maze.LEFT):
    assert not bool(maze.rollout_success(grid, jnp.asarray(np.r_[first, path[:-1]])))


def test_episode_ends_at_goal_wall_or_done():
  grid = jnp.asarray(_mazes(9, 1)[0])
  path, length = (np.asarray(x) for x in maze.shortest_path(grid, 31))
  early_done = path.copy()
  early_done[length - 1] = maze.DONE  # gives up one square short of the goal
  assert not bool(maze.rollout_success(grid, jnp.asarray(early_done)))
  np.testing.assert_array_equal(maze.episode_mask(grid, jnp.asarray(early_done)),
                                np.arange(31) < length)
  wander = path.copy()
  wander[length:] = maze.UP  # after the goal the walk may even hit a wall
  assert bool(maze.rollout_success(grid, jnp.asarray(wander)))
  np.testing.assert_array_equal(maze.episode_mask(grid, jnp.asarray(wander)),
                                np.arange(31) < length)
  truncated = path[:length]  # no DONE at all: still a success
  assert bool(maze.rollout_success(grid, jnp.asarray(truncated)))
  assert not bool(maze.rollout_success(grid, jnp.asarray(truncated[:-1])))  # step limit
  bump = np.r_[maze.UP, path[:-1]]  # a wall at once: the episode is that one action
  np.testing.assert_array_equal(maze.episode_mask(grid, jnp.asarray(bump)), np.arange(31) < 1)


@pytest.mark.slow
def test_random_walks_match_reference_and_vmap():
  grids = _mazes(5, 8, seed=2)  # small mazes so that random walks sometimes succeed
  actions = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (8, 64, 8), 0, 5))
  grid_batch = jnp.repeat(jnp.asarray(grids), 64, axis=0)
  flat_actions = jnp.asarray(actions.reshape(-1, 8))
  rewards = np.asarray(jax.jit(jax.vmap(maze.reward))(grid_batch, flat_actions))
  assert rewards.dtype == np.float32 and set(np.unique(rewards)) <= {0.0, 1.0}
  assert 0 < rewards.sum() < rewards.size
  expected = [_reference_success(g, a)
              for g, a in zip(np.asarray(grid_batch), actions.reshape(-1, 8), strict=True)]
  np.testing.assert_array_equal(rewards, np.asarray(expected, np.float32))
  single_reward = jax.jit(maze.reward)
  singles = [float(single_reward(g, a)) for g, a in zip(grid_batch[:40], flat_actions[:40],
                                                      strict=True)]
  np.testing.assert_array_equal(rewards[:40], singles)


def test_generation_and_paths_under_vmap_equal_single_calls():
  keys = jax.random.split(jax.random.PRNGKey(5), 4)
  batch = jax.vmap(lambda key: maze.generate(key, 9))(keys)
  paths, _ = jax.vmap(lambda g: maze.shortest_path(g, 31))(batch)
  for key, grid, path in zip(keys, batch, paths, strict=True):
    np.testing.assert_array_equal(grid, maze.generate(key, 9))
    np.testing.assert_array_equal(path, maze.shortest_path(grid, 31)[0])


@pytest.fixture(scope="module")
def policy_setup():
  policy = MazePolicy(size=9, max_steps=5, dim=32, num_layers=2, num_heads=4)
  params = policy.init(jax.random.PRNGKey(0))
  mazes = jnp.asarray(_mazes(9, 3, seed=4))
  return policy, params, mazes, jax.jit(policy.log_prob)


@pytest.mark.slow
def test_sampled_log_probs_equal_scoring(policy_setup):
  policy, params, mazes, log_prob = policy_setup
  actions, sampled = jax.jit(policy.sample, static_argnums=3)(params, mazes,
                                                              jax.random.PRNGKey(1), 32)
  assert actions.shape == (3, 32, 5) and sampled.shape == (3, 32)
  np.testing.assert_allclose(sampled, log_prob(params, mazes, actions), rtol=1e-5, atol=1e-4)
  # Sequences are padded with DONE after their episode ends.
  in_episode = jax.vmap(jax.vmap(maze.episode_mask, in_axes=(None, 0)))(mazes, actions)
  assert bool(jnp.any(~in_episode))
  assert bool(jnp.all(jnp.where(in_episode, True, actions == maze.DONE)))


@pytest.mark.slow
def test_log_probs_of_all_episodes_sum_to_one(policy_setup):
  policy, params, mazes, log_prob = policy_setup
  # All 5^T sequences, each distinct episode (the actions its mask keeps) counted once.
  sequences = np.array(list(itertools.product(range(5), repeat=5)))
  masks = np.asarray(jax.vmap(maze.episode_mask, in_axes=(None, 0))(mazes[0], sequences))
  episodes = {tuple(np.where(mask, seq, -1)): i for i, (seq, mask) in enumerate(
      zip(sequences, masks, strict=True))}
  distinct = jnp.asarray(sequences[sorted(episodes.values())])[None]
  total = jnp.sum(jnp.exp(log_prob(params, mazes[:1], distinct)))
  np.testing.assert_allclose(total, 1.0, rtol=1e-5)


def test_log_prob_ignores_actions_after_the_episode(policy_setup):
  _, params, mazes, log_prob = policy_setup
  # UP from the start hits the border wall: the episode is that single action.
  padded = jnp.asarray([[[maze.UP, maze.DONE, maze.DONE, maze.DONE, maze.DONE],
                         [maze.UP, maze.RIGHT, maze.DOWN, maze.LEFT, maze.UP]]])
  scores = log_prob(params, mazes[:1], padded)
  np.testing.assert_allclose(scores[0, 0], scores[0, 1], rtol=1e-6)


@pytest.mark.slow
def test_flat_rollouts_match_grouped_api(policy_setup):
  policy, params, mazes, log_prob = policy_setup
  maze_ids = jnp.array([2, 0, 0, 1, 2, 2])
  actions, sampled = jax.jit(policy.sample_rollouts)(params, mazes, maze_ids,
                                                      jax.random.PRNGKey(7))
  grouped = log_prob(params, mazes[maze_ids], actions[:, None])[:, 0]
  np.testing.assert_allclose(sampled, grouped, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_sampling_a_buffer_in_chunks_draws_what_sampling_it_at_once_does(policy_setup):
  policy, params, mazes, _ = policy_setup
  maze_ids = jnp.asarray([0, 0, 1, 2, 2, 2, 1, 0])
  key = jax.random.PRNGKey(3)
  whole = policy.sample_rollouts(params, mazes, maze_ids, key)
  rollout_ids = jnp.arange(8)
  halves = [policy.sample_rollouts(params, mazes, maze_ids[part], key, rollout_ids[part])
            for part in (slice(0, 4), slice(4, 8))]
  np.testing.assert_array_equal(whole[0], jnp.concatenate([h[0] for h in halves]))
  np.testing.assert_allclose(whole[1], jnp.concatenate([h[1] for h in halves]), rtol=1e-6)
