"""sera_jax: Scale-Equalized Rollout Allocation for Maximum Likelihood RL."""

from importlib import metadata

from sera_jax.method.allocation import MODES, Allocation, allocate, clamp_log_p, max_count
from sera_jax.method.estimators import (
    ESTIMATORS,
    advantages,
    estimator_spec,
    expected_scale,
    policy_loss,
    register_estimator,
    registered_estimators,
)
from sera_jax.method.flat import (
    flat_advantages,
    flat_policy_loss,
    rollout_segments,
    rollout_weights,
)
from sera_jax.method.historical import historical_allocation
from sera_jax.method.registry import (
    ALLOCATORS,
    AllocationConfig,
    AllocationInputs,
    Allocator,
    allocate_with,
)
from sera_jax.method.scaling import (
    coverage,
    failure_rate,
    fidelity,
    log1mexp,
    mixed_probability,
    truncated_objective,
)
from sera_jax.method.success import (
    HistoricalState,
    historical_estimate,
    historical_init,
    historical_population_log_p,
    historical_stage,
    historical_start_epoch,
    oracle_log_p,
    pilot_budget_split,
    pilot_log_p,
)
from sera_jax.settings.classification.gradients import (
    Rollouts,
    estimate_logit_grad,
    exact_logit_grad,
    expected_logit_grad,
    sample_rollouts,
)

try:
  __version__ = metadata.version("sera_jax")
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
  __version__ = "0+unknown"

__all__ = [
    "ALLOCATORS",
    "ESTIMATORS",
    "MODES",
    "Allocation",
    "AllocationConfig",
    "AllocationInputs",
    "Allocator",
    "HistoricalState",
    "Rollouts",
    "advantages",
    "allocate",
    "allocate_with",
    "clamp_log_p",
    "coverage",
    "estimate_logit_grad",
    "estimator_spec",
    "exact_logit_grad",
    "expected_logit_grad",
    "expected_scale",
    "failure_rate",
    "fidelity",
    "flat_advantages",
    "flat_policy_loss",
    "historical_allocation",
    "historical_estimate",
    "historical_init",
    "historical_population_log_p",
    "historical_stage",
    "historical_start_epoch",
    "log1mexp",
    "max_count",
    "mixed_probability",
    "oracle_log_p",
    "pilot_budget_split",
    "pilot_log_p",
    "policy_loss",
    "register_estimator",
    "registered_estimators",
    "rollout_segments",
    "rollout_weights",
    "sample_rollouts",
    "truncated_objective",
]
