"""sera_jax: Scale-Equalized Rollout Allocation for Maximum Likelihood RL."""

from sera_jax.allocation import MODES, Allocation, allocate, clamp_log_p
from sera_jax.scaling import (
    coverage,
    failure_rate,
    fidelity,
    log1mexp,
    mixed_probability,
    truncated_objective,
)

__all__ = [
    "MODES",
    "Allocation",
    "allocate",
    "clamp_log_p",
    "coverage",
    "failure_rate",
    "fidelity",
    "log1mexp",
    "mixed_probability",
    "truncated_objective",
]
