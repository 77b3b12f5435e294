"""The allocation step of every setting that visits a fixed prompt set in epochs.

`historical_allocation` is the one place where a batch's allocation meets the historical
estimator (docs/method.md#estimating-p): the epoch-start fold, the frozen estimate, the
rule for prompts without an estimate of their own, and when the allocation is uniform.
The classification figures, the maze and the LLM learner all call it.
"""

import jax
import jax.numpy as jnp

from sera_jax.method import success
from sera_jax.method.allocation import Allocation
from sera_jax.method.registry import AllocationConfig, AllocationInputs, allocate_with


def _estimate(config: AllocationConfig, state: success.HistoricalState, prompt_ids: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
  """The batch's frozen log p, the population's mean p where a prompt has no estimate yet.

  Returns:
    (log_p [M], any_seen: scalar bool, whether any prompt at all has an estimate).
  """
  prior = dict(alpha0=config.alpha0, beta0=config.beta0)
  own, has_estimate = success.historical_estimate(state, prompt_ids, **prior)
  population, any_seen = success.historical_population_log_p(state, **prior)
  return jnp.where(has_estimate, own, population), any_seen


def historical_allocation(config: AllocationConfig, state: success.HistoricalState,
                          prompt_ids: jax.Array, new_epoch, training,
                          inputs: AllocationInputs | None = None
                          ) -> tuple[success.HistoricalState, Allocation, jax.Array]:
  """A batch's allocation on the historical estimate of p (docs/method.md#estimating-p).

  1. At an epoch boundary (`new_epoch`) the outcomes staged in the epoch before are
     folded in (`success.historical_start_epoch` with `config.discount`).
  2. log p is the frozen estimate (`success.historical_estimate`, prior alpha0, beta0).
     A prompt with no estimate of its own (not rolled out before the last boundary: the
     leftover of an epoch that does not divide into batches, or a prompt added later)
     gets the mean p of the prompts that have one (`success.historical_population_log_p`),
     so the rest of its batch keeps `config.mode`'s allocation.
  3. The allocation is `config.mode`'s (`registry.allocate_with`), except that it is
     uniform (N0 rollouts each) while no prompt at all has an estimate (the first
     epoch) and for evaluation batches (`training` False).

  Pure and jittable with `config` static; `new_epoch` and `training` may be traced.
  The caller stages the batch's outcomes in the returned state once they are known.

  Args:
    config: the experiment's allocation.
    state: the estimator's state before this batch.
    prompt_ids: [M] integer ids in [0, P) of the batch's prompts.
    new_epoch: scalar bool, whether this batch opens an epoch after the first.
    training: scalar bool, False for an evaluation batch.
    inputs: what else the batch offers the mode (gvm's grad_norm, adaptive's
      outcomes). A log_p given there (an oracle's) is allocated on in place of the
      estimate, and the history is still kept; the allocation is then uniform only
      for evaluation batches.

  Returns:
    (the state, folded if `new_epoch`; the `Allocation`; the [M] log p it used).
  """
  started = success.historical_start_epoch(state, discount=config.discount)
  state = jax.tree.map(lambda fold, keep: jnp.where(new_epoch, fold, keep), started, state)
  inputs = AllocationInputs() if inputs is None else inputs
  if inputs.log_p is None:
    log_p, informed = _estimate(config, state, prompt_ids)
  else:
    log_p, informed = jnp.asarray(inputs.log_p), True
  inputs = inputs._replace(log_p=log_p)
  alloc = allocate_with(config, inputs)  # first: refuses inputs the mode cannot run on
  if config.mode != "uniform":
    uniform = allocate_with(config.replace(mode="uniform"), inputs)
    chosen = jnp.logical_and(training, informed)
    alloc = jax.tree.map(lambda mode, even: jnp.where(chosen, mode, even), alloc, uniform)
  return state, alloc, log_p
