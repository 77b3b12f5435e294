"""Estimates of a prompt's success probability p, in log space (docs/method.md#estimating-p).

* Oracle (classification): log p = log_softmax(logits)[label].
* Historical (epochs over a fixed prompt set): a discounted Beta posterior per
  prompt, kept as a pure `HistoricalState` (optax style: a NamedTuple of arrays
  indexed by a dense prompt id, updated by pure functions, saved by Orbax as is).
  Outcomes of the current epoch are *staged* and folded in only at the next
  epoch boundary, so estimates are frozen within an epoch.
* Pilot (fresh prompts each step): a first stage of `num_pilot` rollouts per
  prompt gives a Beta posterior mean; the rest of the budget is allocated on it.

Every estimate is a log-probability, the input of `sera_jax.allocation.allocate`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sera_jax.method import validation

# The estimators' defaults (docs/method.md#estimating-p), defined here once: the settings'
# configs and `sera_jax.method.registry.AllocationConfig` start from them.
DISCOUNT = 0.75  # the weight of the folded counts at each epoch boundary
ALPHA0 = 0.5  # the Beta prior (alpha0, beta0)
BETA0 = 0.5


def oracle_log_p(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """log p_q = log softmax(logits_q)[y_q] (docs/method.md#estimating-p, oracle).

  Taken from `jax.nn.log_softmax`, so it stays finite however peaked the
  logits are (a gap of 1e4 gives log p = -1e4, not log 0).

  Args:
    logits: [M, C] class logits of each prompt.
    labels: [M] integer correct classes in [0, C).

  Returns:
    [M] log success probabilities in the floating dtype of `logits`.
  """
  logits = jnp.asarray(logits)
  labels = jnp.asarray(labels)
  validation.rank("logits", logits, 2)
  validation.indices("labels", labels, logits.shape[1], rows_of=("logits", logits))
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]


def _log_beta_mean(successes, failures, alpha0: float, beta0: float) -> jax.Array:
  """log((alpha0 + S) / (alpha0 + beta0 + S + F)), the log posterior mean of Beta(alpha0, beta0)."""
  return jnp.log(alpha0 + successes) - jnp.log(alpha0 + beta0 + successes + failures)


def _check_prior(alpha0: float, beta0: float) -> None:
  """Refuses a concrete alpha0 or beta0 <= 0 (a traced one is a batch's run's, checked where
  its config was built)."""
  for name, value in (("alpha0", alpha0), ("beta0", beta0)):
    if validation.is_concrete(value) and not float(value) > 0:
      raise ValueError(f"{name} must be > 0 (a proper Beta prior); got {value!r}.")


class HistoricalState(NamedTuple):
  """Discounted Beta counts per prompt (docs/method.md#estimating-p), indexed by dense prompt id.

  Attributes:
    successes: [P] folded, discounted success counts S.
    failures: [P] folded, discounted failure counts F.
    staged_successes: [P] successes observed in the current epoch, not yet folded.
    staged_failures: [P] failures observed in the current epoch, not yet folded.
    seen: [P] bool, True once at least one rollout of the prompt has been folded.
  """
  successes: jax.Array
  failures: jax.Array
  staged_successes: jax.Array
  staged_failures: jax.Array
  seen: jax.Array


def historical_init(num_prompts: int, dtype=jnp.float32) -> HistoricalState:
  """Empty state for prompt ids 0..num_prompts-1: no counts, nothing seen."""
  num_prompts = validation.integer("num_prompts", num_prompts, minimum=1)
  zeros = jnp.zeros((num_prompts,), dtype)
  return HistoricalState(successes=zeros, failures=zeros, staged_successes=zeros,
                         staged_failures=zeros, seen=jnp.zeros((num_prompts,), jnp.bool_))


def historical_stage(state: HistoricalState, prompt_ids: jax.Array, rewards: jax.Array,
                     mask: jax.Array) -> HistoricalState:
  """Stages this epoch's outcomes of M groups; estimates do not change until the next epoch.

  Args:
    state: the current state.
    prompt_ids: [M] integer ids in [0, P); repeated ids accumulate. Checked only
      when concrete: under `jax.jit` an out-of-range id is dropped (JAX scatter rule).
    rewards: [M, N] 0/1 rewards (padded).
    mask: [M, N] boolean-like, True on real rollouts.

  Returns:
    The state with staged_successes / staged_failures increased by each group's
    sum_j r_j mask_j / sum_j (1 - r_j) mask_j.
  """
  prompt_ids = jnp.asarray(prompt_ids)
  rewards = validation.binary("rewards", rewards)
  mask = validation.mask("mask", mask)
  validation.rank("rewards", rewards, 2)
  validation.same_shape(("rewards", "mask"), rewards, mask)
  validation.indices("prompt_ids", prompt_ids, state.successes.shape[0],
                     rows_of=("rewards", rewards))
  dtype = state.successes.dtype
  valid = mask.astype(dtype)
  rewards = rewards.astype(dtype)
  return _stage(state, prompt_ids, jnp.sum(rewards * valid, axis=1),
                jnp.sum((1 - rewards) * valid, axis=1))


def historical_stage_flat(state: HistoricalState, prompt_ids: jax.Array, rewards: jax.Array,
                          segment_ids: jax.Array) -> HistoricalState:
  """`historical_stage` of M groups held in a flat buffer (docs/method.md#llm-post-training).

  Args:
    state: the current state.
    prompt_ids: [M] integer ids in [0, P) of the batch's prompts.
    rewards: [B] 0/1 rewards of the buffer.
    segment_ids: int [B], each rollout's group in [0, M) (`sera_jax.rollout_segments`).

  Returns:
    The state with each prompt's successes and failures of this buffer staged.
  """
  prompt_ids, segment_ids = jnp.asarray(prompt_ids), jnp.asarray(segment_ids)
  rewards = validation.binary("rewards", rewards)
  validation.rank("prompt_ids", prompt_ids, 1)
  validation.rank("rewards", rewards, 1)
  validation.same_shape(("rewards", "segment_ids"), rewards, segment_ids)
  validation.indices("prompt_ids", prompt_ids, state.successes.shape[0])
  validation.indices("segment_ids", segment_ids, prompt_ids.shape[0])
  rewards = rewards.astype(state.successes.dtype)
  num_groups = prompt_ids.shape[0]
  successes = jax.ops.segment_sum(rewards, segment_ids, num_groups)
  failures = jax.ops.segment_sum(1 - rewards, segment_ids, num_groups)
  return _stage(state, prompt_ids, successes, failures)


def _stage(state: HistoricalState, prompt_ids, successes, failures) -> HistoricalState:
  return state._replace(
      staged_successes=state.staged_successes.at[prompt_ids].add(successes),
      staged_failures=state.staged_failures.at[prompt_ids].add(failures))


def historical_start_epoch(state: HistoricalState, *,
                           discount: float = DISCOUNT) -> HistoricalState:
  """Folds the staged outcomes in at an epoch boundary (docs/method.md#estimating-p).

  S <- d S + staged S and F <- d F + staged F for every prompt (prompts not
  rolled out this epoch only decay), staged counts are cleared, and a prompt
  becomes `seen` once any rollout of it has been folded.
  """
  if validation.is_concrete(discount):
    discount = validation.in_unit_interval("discount", discount)
  staged_any = (state.staged_successes + state.staged_failures) > 0
  zeros = jnp.zeros_like(state.staged_successes)
  return HistoricalState(
      successes=discount * state.successes + state.staged_successes,
      failures=discount * state.failures + state.staged_failures,
      staged_successes=zeros,
      staged_failures=zeros,
      seen=state.seen | staged_any)


def historical_estimate(state: HistoricalState, prompt_ids: jax.Array, *,
                        alpha0: float = ALPHA0, beta0: float = BETA0
                        ) -> tuple[jax.Array, jax.Array]:
  """Frozen estimate log p = log((alpha0 + S) / (alpha0 + beta0 + S + F)).

  See docs/method.md#estimating-p.

  Depends only on the folded S, F, never on staged outcomes, so it is constant
  within an epoch. Prompts never seen have no estimate: `has_estimate` is
  False there and `log_p` holds the prior mean log(alpha0 / (alpha0 + beta0)).
  `sera_jax.method.historical.historical_allocation` gives them the population's
  mean (`historical_population_log_p`) and allocates uniformly while nothing is seen.

  Args:
    state: the current state.
    prompt_ids: [M] integer ids in [0, P).
    alpha0, beta0: the Beta prior, both > 0.

  Returns:
    (log_p [M], has_estimate bool [M]).
  """
  _check_prior(alpha0, beta0)
  prompt_ids = jnp.asarray(prompt_ids)
  validation.indices("prompt_ids", prompt_ids, state.successes.shape[0])
  log_p = _log_beta_mean(state.successes[prompt_ids], state.failures[prompt_ids], alpha0, beta0)
  return log_p, state.seen[prompt_ids]


def historical_population_log_p(state: HistoricalState, *, alpha0: float = ALPHA0,
                                beta0: float = BETA0) -> tuple[jax.Array, jax.Array]:
  """log of the mean frozen estimate p over every seen prompt, for prompts not yet seen.

  A prompt that missed the epochs so far (the leftover of an epoch that does not
  divide into batches, or a prompt added later) has no estimate of its own; the
  mean p of the prompt population is the best guess that ignores its text, and
  lets the rest of its batch keep SERA's allocation.

  Args:
    state: the current state.
    alpha0, beta0: the Beta prior, both > 0.

  Returns:
    (log mean p, scalar; any_seen, scalar bool: False before the first epoch
    boundary, when the value is the prior mean's log).
  """
  _check_prior(alpha0, beta0)
  log_p = _log_beta_mean(state.successes, state.failures, alpha0, beta0)
  num_seen = jnp.sum(state.seen)
  log_mean = (jax.scipy.special.logsumexp(jnp.where(state.seen, log_p, -jnp.inf))
              - jnp.log(jnp.maximum(num_seen, 1)))
  prior = jnp.log(alpha0 / (alpha0 + beta0)).astype(log_p.dtype)
  return jnp.where(num_seen > 0, log_mean, prior), num_seen > 0


def pilot_log_p(successes: jax.Array, num_pilot: int, *, alpha0: float = ALPHA0,
                beta0: float = BETA0) -> jax.Array:
  """log((alpha0 + s) / (alpha0 + beta0 + num_pilot)): Beta posterior mean after a pilot.

  Args:
    successes: [M] successes among each prompt's `num_pilot` pilot rollouts.
    num_pilot: pilot rollouts per prompt (>= 0; 0 gives the prior mean).
    alpha0, beta0: the Beta prior, both > 0.

  Returns:
    [M] log success probabilities (float32 by default), finite and < 0.
  """
  num_pilot = validation.integer("num_pilot", num_pilot, minimum=0)
  _check_prior(alpha0, beta0)
  successes = jnp.asarray(successes)
  if not jnp.issubdtype(successes.dtype, jnp.floating):
    successes = successes.astype(jnp.result_type(float))
  if validation.is_concrete(successes):
    values = np.asarray(successes)
    bad = (values < 0) | (values > num_pilot) | (values != np.round(values))
    if bad.any():
      raise ValueError(
          f"successes must be integers in [0, num_pilot = {num_pilot}]; found "
          f"{values[bad][0].item()!r}.")
  return _log_beta_mean(successes, num_pilot - successes, alpha0, beta0)


def pilot_budget_split(baseline_n: int, num_pilot: int) -> int:
  """Per-prompt baseline left for the second stage after a pilot of `num_pilot` rollouts.

  The pilot spends M * num_pilot of the budget M * baseline_n; the rest,
  M * (baseline_n - num_pilot), is allocated on the pilot estimate:

      log_p = pilot_log_p(pilot_successes, num_pilot)
      rest = pilot_budget_split(baseline_n, num_pilot)
      allocation = allocate(log_p, baseline_n=rest, n_min=..., n_max=...)

  with n_min <= rest <= n_max. The pilot rollouts only estimate p; the
  gradient uses the second-stage groups (counts `allocation.counts`,
  weights `allocation.weights`, `policy_loss(..., baseline_n=rest)`), which
  are sampled after, and independently of, the pilot, so reusing no pilot
  outcome keeps E[g] = c(p, n) grad log p exact.

  Args:
    baseline_n: N0, the per-prompt budget of the whole step.
    num_pilot: pilot rollouts per prompt, 1 <= num_pilot < baseline_n.

  Returns:
    baseline_n - num_pilot, the second stage's per-prompt baseline.
  """
  baseline_n = validation.integer("baseline_n", baseline_n, minimum=2)
  num_pilot = validation.integer("num_pilot", num_pilot, minimum=1)
  if num_pilot >= baseline_n:
    raise ValueError(
        f"num_pilot must be < baseline_n = {baseline_n} (leave budget for the second stage); "
        f"got {num_pilot}.")
  return baseline_n - num_pilot
