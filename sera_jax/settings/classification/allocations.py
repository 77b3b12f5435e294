"""Every allocation mode of the controlled setting: SERA's and the baselines'.

SERA's modes (`sera_jax.allocate`: uniform, equalized, sera) need log p. The
baselines of `sera_jax.method.allocators` need more, which classification
knows exactly:

* knapsack (Knapsack-RL): log p alone;
* gvm (GVM-RAFT): each prompt's gradient norm G_q = ||d log p_q / d logits_q||
  = ||onehot(y_q) - pi_q|| (`log_p_grad_norm`);
* adaptive (rounds with early exit): the outcomes of the rollouts themselves.
  Slot j of prompt q succeeds exactly as in `gradients.sample_rollouts` with the
  key the gradient then samples with (a slot's randomness depends on the key,
  q and j alone), so the counts are decided by the very rollouts the estimate
  uses, as in the method. Its counts are random, and its expected gradient has
  no closed form (the alignment figures estimate it by Monte Carlo).

`inputs` gathers what a mode needs from the logits, and `allocate` is a pure
function of those per-prompt arrays, so a mesh can solve it on every device.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sera_jax.method import allocation, allocators
from sera_jax.method.success import oracle_log_p
from sera_jax.settings.classification import gradients

MODES = allocation.MODES + allocators.MODES
OUTCOME_DEPENDENT = ("adaptive",)  # counts drawn with the rollouts: no closed-form expectation
ROUND_SIZE = 2  # adaptive sampling's rollouts per open prompt and round


class Inputs(NamedTuple):
  """What the allocation of a batch of M prompts reads.

  Attributes:
    log_p: [M] log p (exact, or an estimate), not differentiated.
    grad_norm: [M] ||d log p_q / d logits_q|| (gvm), or [0] when the mode needs none.
    outcomes: bool [M, n_max] the rollouts' slot successes (adaptive), or [M, 0].
  """
  log_p: jax.Array
  grad_norm: jax.Array
  outcomes: jax.Array


def log_p_grad_norm(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """[M] ||onehot(y_q) - softmax(logits_q)||: the norm of d log p_q / d logits_q."""
  onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
  return jnp.linalg.norm(onehot - jax.nn.softmax(logits, axis=-1), axis=-1)


def inputs(mode: str, logits: jax.Array, labels: jax.Array, key: jax.Array, *, n_max: int,
           log_p: jax.Array | None = None) -> Inputs:
  """The allocation inputs of `mode` on one batch.

  Args:
    mode: one of `MODES`.
    logits, labels: [M, C] and [M].
    key: the key the gradient's rollouts are sampled with (read by adaptive only).
    n_max: the most rollouts of a prompt (static): adaptive's outcome width.
    log_p: an estimate of log p to allocate on; default the exact one.
  """
  logits = jax.lax.stop_gradient(logits)
  log_p = oracle_log_p(logits, labels) if log_p is None else jax.lax.stop_gradient(log_p)
  grad_norm = log_p_grad_norm(logits, labels) if mode == "gvm" else jnp.zeros(0, logits.dtype)
  if mode == "adaptive":
    counts = jnp.full(labels.shape, n_max, jnp.int32)
    outcomes = gradients.sample_rollouts(key, logits, labels, counts,
                                         max_rollouts=n_max).rewards > 0
  else:
    outcomes = jnp.zeros((labels.shape[0], 0), bool)
  return Inputs(log_p, grad_norm, outcomes)


def allocate(mode: str, batch: Inputs, *, baseline_n: int, n_min: int, n_max: int,
             round_size: int = ROUND_SIZE, **options) -> allocation.Allocation:
  """The `Allocation` of `mode` (budget M * baseline_n, counts in [n_min, n_max]).

  `options` (threshold, normalize_by_rollout_count, normalize_by_rho) go to
  `sera_jax.allocate` for SERA's modes; the baselines have none of them.
  """
  bounds = dict(baseline_n=baseline_n, n_min=n_min, n_max=n_max)
  if mode in allocation.MODES:
    return allocation.allocate(batch.log_p, mode=mode, **bounds, **options)
  if mode == "knapsack":
    return allocators.knapsack(batch.log_p, **bounds)
  if mode == "gvm":
    return allocators.gvm(batch.log_p, batch.grad_norm, **bounds)
  if mode == "adaptive":
    return allocators.adaptive(batch.outcomes, batch.log_p, round_size=round_size, **bounds)
  raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")


def config_options(config) -> dict:
  """SERA's allocation options of an experiment config."""
  return dict(threshold=config.threshold,
              normalize_by_rollout_count=config.normalize_by_rollout_count,
              normalize_by_rho=config.normalize_by_rho)
