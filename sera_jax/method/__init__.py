"""The method: pure, jittable functions of SERA and MaxRL.

See docs/method.md#the-estimator-and-its-scale.

* `scaling`: kappa (fidelity), coverage (pass@n), mixed probability, in log space;
* `allocation`: the waterline allocation `allocate` -> `Allocation`;
* `allocators`: the baseline allocators (Knapsack-RL, GVM-RAFT, adaptive sampling);
* `registry`: `AllocationConfig`, `AllocationInputs` and every mode by name (`ALLOCATORS`);
* `historical`: `historical_allocation`, the allocation step on the historical estimate;
* `estimators`: advantages, their exact expected scales, the policy loss;
* `success`: estimates of log p (oracle, historical discounted Beta, pilot);
* `validation`: the argument checks of every public boundary;
* `ordering`: sortable keys of floats and stable-sort prefixes (the allocators' ranking).

These modules import jax, numpy and chex only: nothing of the settings, the
shared pieces or the harness.
"""

from sera_jax.method.historical import historical_allocation
from sera_jax.method.registry import (
    ALLOCATORS,
    AllocationConfig,
    AllocationInputs,
    Allocator,
    allocate_with,
)

__all__ = [
    "ALLOCATORS",
    "AllocationConfig",
    "AllocationInputs",
    "Allocator",
    "allocate_with",
    "historical_allocation",
]
