"""What the controlled setting feeds the allocation modes: every input, exactly.

Every mode of `sera_jax.method.registry` reads log p; classification knows it, and
also what the baselines of `sera_jax.method.allocators` read beyond it:

* gvm (GVM-RAFT): each prompt's gradient norm G_q = ||d log p_q / d logits_q||
  = ||onehot(y_q) - pi_q|| (`log_p_grad_norm`);
* adaptive (rounds with early exit): the outcomes of the rollouts themselves.
  Slot j of prompt q succeeds exactly as in `gradients.sample_rollouts` with the
  key the gradient then samples with (a slot's randomness depends on the key,
  q and j alone), so the counts are decided by the very rollouts the estimate
  uses, as in the method. Its counts are random, and its expected gradient has
  no closed form (the alignment figures estimate it by Monte Carlo).

`inputs` gathers what a config's mode reads from the logits, and
`registry.allocate_with` is a pure function of those per-prompt arrays, so a mesh
can solve it on every device. `historical_allocation` allocates training prompts on
their historical estimate instead of the exact p (the figures replay epochs with it).
"""

import jax
import jax.numpy as jnp

from sera_jax.method import historical, registry, success
from sera_jax.method.allocation import Allocation
from sera_jax.settings.classification import gradients

INPUTS = registry.AllocationInputs._fields  # classification feeds every input
MODES = registry.modes_fed_by(INPUTS)


def allocation_config(config, mode: str) -> registry.AllocationConfig:
  """The allocation of an experiment config (its keys named as the fields) in `mode`."""
  return registry.AllocationConfig.from_fields(config, prefix="config.", mode=mode)


def log_p_grad_norm(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """[M] ||onehot(y_q) - softmax(logits_q)||: the norm of d log p_q / d logits_q."""
  onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
  return jnp.linalg.norm(onehot - jax.nn.softmax(logits, axis=-1), axis=-1)


def _beyond_log_p(config: registry.AllocationConfig, logits: jax.Array, labels: jax.Array,
                  key: jax.Array) -> registry.AllocationInputs:
  """The inputs other than log p that `config.mode` reads (None for the rest)."""
  needs = registry.ALLOCATORS[config.mode].needs
  logits = jax.lax.stop_gradient(logits)
  grad_norm = log_p_grad_norm(logits, labels) if "grad_norm" in needs else None
  outcomes = None
  if "outcomes" in needs:
    counts = jnp.full(labels.shape, config.n_max, jnp.int32)
    outcomes = gradients.sample_rollouts(key, logits, labels, counts,
                                         max_rollouts=config.n_max).rewards > 0
  return registry.AllocationInputs(grad_norm=grad_norm, outcomes=outcomes)


def inputs(config: registry.AllocationConfig, logits: jax.Array, labels: jax.Array,
           key: jax.Array, *, log_p: jax.Array | None = None) -> registry.AllocationInputs:
  """The allocation inputs of `config.mode` on one batch.

  Args:
    config: the allocation; adaptive's outcomes are config.n_max slots wide.
    logits, labels: [M, C] and [M].
    key: the key the gradient's rollouts are sampled with (read by adaptive only).
    log_p: an estimate of log p to allocate on; default the exact one.
  """
  if log_p is None:
    log_p = success.oracle_log_p(jax.lax.stop_gradient(logits), labels)
  return _beyond_log_p(config, logits, labels, key)._replace(log_p=log_p)


def historical_allocation(config: registry.AllocationConfig, state: success.HistoricalState,
                          prompt_ids: jax.Array, new_epoch, training, logits: jax.Array,
                          labels: jax.Array, key: jax.Array
                          ) -> tuple[success.HistoricalState, Allocation, jax.Array]:
  """The allocation of training prompts `prompt_ids` on their historical estimate of p.

  `sera_jax.method.historical.historical_allocation`, given the inputs other than log p
  that `config.mode` reads from the prompts' logits, labels and key (see `inputs`).

  Returns:
    (the state, folded if `new_epoch`; the `Allocation`; the [M] log p it used).
  """
  return historical.historical_allocation(config, state, prompt_ids, new_epoch, training,
                                          _beyond_log_p(config, logits, labels, key))
