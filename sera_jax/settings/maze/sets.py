"""The maze sets of a data seed: a supervised pool, the RL set, validation and held-out mazes.

The protocol is the paper's (docs/method.md#maze-navigation):

* the **RL set** is a fixed set of distinct mazes, revisited epoch after epoch;
* the **held-out** and **validation** sets are fresh i.i.d. mazes, unfiltered but for being
  distinct from every maze drawn before them (at 13x13 a repeat is as good as impossible,
  and the counts say so);
* the **supervised pool** (the warm start's data, each maze seen once) shares no maze with
  the three sets, and, with `disjoint_paths`, no shortest path either: the warm start has
  then imitated no solution of an RL, validation or held-out maze, so RL reward earned from
  step one is not recall.

Each set is drawn from its own key (`jax.random.fold_in(PRNGKey(data_seed), tag)`), in chunks
of candidates, so a set does not change when another set's size does (the pool, drawn last,
does: it avoids the others). A perfect maze has one shortest path, and a maze-blind policy
that replays training solutions solves exactly the mazes whose path it replays
(`replay_pass_at_k`); `unseen_path` marks the held-out mazes whose path no RL maze has.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sera_jax.settings.maze import env as maze_env

# Key tags of the sets (folded into PRNGKey(data_seed)); 0, 1 and 5 drew these sets before
# the pool existed, so the RL, held-out and validation mazes of a data seed are unchanged.
RL_SET, HELD_OUT, SFT_POOL, VALIDATION = 0, 1, 3, 5
CHUNK = 256  # candidates generated at a time


class MazeSet(NamedTuple):
  """Mazes bool [N, size, size] with their shortest paths int32 [N, T], and how many
  candidates were generated to find them."""
  mazes: np.ndarray
  paths: np.ndarray
  candidates: int


class MazeSets(NamedTuple):
  """Every maze set of a data seed, and the overlaps between them counted from the sets."""
  sft: MazeSet
  rl: MazeSet
  held_out: MazeSet
  validation: MazeSet
  unseen_path: np.ndarray  # bool [num held-out]: no RL maze has this held-out maze's path

  def overlaps(self) -> dict[str, int]:
    """Mazes (by layout) shared between the sets, counted: 0 by construction."""
    evaluation = _rows(self.held_out.mazes) | _rows(self.validation.mazes)
    return {"sft_rl": count_shared(self.sft.mazes, _rows(self.rl.mazes)),
            "sft_eval": count_shared(self.sft.mazes, evaluation),
            "rl_eval": count_shared(self.rl.mazes, evaluation),
            "held_out_validation": count_shared(self.held_out.mazes,
                                                _rows(self.validation.mazes))}

  def shared_paths(self) -> dict[str, int]:
    """Mazes of one set whose shortest path a maze of another has, counted. The pool's are 0
    when it was drawn path-disjoint; the RL set's with the evaluation sets are what i.i.d.
    sets share (the held-out ones are the complement of `unseen_path`)."""
    evaluation = _rows(self.held_out.paths) | _rows(self.validation.paths)
    return {"sft_rl": count_shared(self.sft.paths, _rows(self.rl.paths)),
            "sft_eval": count_shared(self.sft.paths, evaluation),
            "held_out_rl": count_shared(self.held_out.paths, _rows(self.rl.paths)),
            "validation_rl": count_shared(self.validation.paths, _rows(self.rl.paths))}


def _flat(array: np.ndarray) -> np.ndarray:
  return array.reshape(len(array), int(np.prod(array.shape[1:])))  # an empty set too


def _rows(array: np.ndarray) -> set[bytes]:
  return {row.tobytes() for row in _flat(array)}


def count_shared(array: np.ndarray, others: set[bytes]) -> int:
  """How many rows of `array` (one maze or path each) are in `others` (`_rows` of a set)."""
  return sum(row.tobytes() in others for row in _flat(array))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _candidates(key: jax.Array, count: int, size: int, max_steps: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(mazes, their shortest paths, their lengths in moves) of `count` fresh mazes."""
  mazes = jax.vmap(lambda k: maze_env.generate(k, size))(jax.random.split(key, count))
  paths, lengths = jax.vmap(lambda m: maze_env.shortest_path(m, max_steps))(mazes)
  return mazes, paths, lengths


def draw(key: jax.Array, count: int, size: int, max_steps: int, *,
         avoid_mazes: frozenset = frozenset(), avoid_paths: frozenset = frozenset(),
         max_candidates: int = 1 << 20) -> MazeSet:
  """`count` distinct mazes solvable within `max_steps` moves, none in `avoid_mazes` and none
  whose shortest path is in `avoid_paths` (byte strings of maze and path rows).

  Candidates are i.i.d. draws of `maze_env.generate`, `CHUNK` at a time from `key`
  (deterministic); those refused are skipped, so the set is the law of a fresh maze
  conditioned on the rules.

  Raises:
    ValueError: fewer than `count` such mazes among `max_candidates`.
  """
  seen_mazes, kept_mazes, kept_paths, candidates = set(avoid_mazes), [], [], 0
  while len(kept_mazes) < count:
    if candidates >= max_candidates:
      raise ValueError(
          f"only {len(kept_mazes)} of {candidates} generated {size}x{size} mazes are distinct, "
          f"solvable within max_steps = {max_steps} moves"
          f"{' and share no shortest path with the other sets' * bool(avoid_paths)}; draw "
          f"fewer mazes, raise maze_size or max_steps"
          f"{', or set config.sft_disjoint_paths = False' * bool(avoid_paths)}.")
    mazes, paths, lengths = jax.device_get(
        _candidates(jax.random.fold_in(key, candidates // CHUNK), CHUNK, size, max_steps))
    candidates += CHUNK
    for maze, path, length in zip(mazes, paths, lengths, strict=True):
      maze_bytes = maze.tobytes()
      if length > max_steps or maze_bytes in seen_mazes or path.tobytes() in avoid_paths:
        continue
      seen_mazes.add(maze_bytes)
      kept_mazes.append(maze)
      kept_paths.append(path)
      if len(kept_mazes) == count:
        break
  shape = (0, size, size), (0, max_steps)
  return MazeSet(np.stack(kept_mazes) if count else np.zeros(shape[0], bool),
                 np.stack(kept_paths) if count else np.zeros(shape[1], np.int32), candidates)


@functools.lru_cache(maxsize=8)
def maze_sets(data_seed: int, size: int, max_steps: int, num_rl: int, num_held_out: int,
              num_validation: int, num_sft: int, sft_disjoint_paths: bool) -> MazeSets:
  """The sets of a data seed (see the module docstring), built once a process and shared
  read-only by every run and method of it.

  Raises:
    ValueError: sets that cannot be drawn (`draw`).
  """
  key = jax.random.PRNGKey(data_seed)
  tagged = functools.partial(jax.random.fold_in, key)
  draw_ = functools.partial(draw, size=size, max_steps=max_steps)
  rl = draw_(tagged(RL_SET), num_rl)
  held_out = draw_(tagged(HELD_OUT), num_held_out, avoid_mazes=frozenset(_rows(rl.mazes)))
  validation = draw_(tagged(VALIDATION), num_validation,
                     avoid_mazes=frozenset(_rows(rl.mazes) | _rows(held_out.mazes)))
  drawn = (rl, held_out, validation)
  sft = draw_(tagged(SFT_POOL), num_sft,
              avoid_mazes=frozenset().union(*(_rows(s.mazes) for s in drawn)),
              avoid_paths=frozenset().union(*(_rows(s.paths) for s in drawn))
              if sft_disjoint_paths else frozenset())
  rl_paths = _rows(rl.paths)
  unseen = np.array([path.tobytes() not in rl_paths for path in held_out.paths], bool)
  return MazeSets(sft, rl, held_out, validation, unseen)


def replay_pass_at_k(train_paths: jax.Array, mazes: jax.Array, ks) -> np.ndarray:
  """pass@k of the maze-blind replay policy: a training solution drawn uniformly (each
  training maze's path at its training frequency), whatever the maze.

  Its success probability on maze m is exact, p_m = mean_t reward(m, path_t),
  and so is its pass@k = mean_m 1 - (1 - p_m)^k.
  """
  solves = jax.vmap(lambda maze: jax.vmap(lambda path: maze_env.reward(maze, path))(
      jnp.asarray(train_paths)))(jnp.asarray(mazes))
  p = np.asarray(jnp.mean(solves, axis=1), np.float64)[:, None]
  return np.mean(-np.expm1(np.asarray(ks)[None, :] * np.log1p(-np.minimum(p, 1.0))), axis=0)
