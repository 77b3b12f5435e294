"""The method: pure, jittable functions of SERA and MaxRL.

See docs/method.md#the-estimator-and-its-scale.

* `scaling`: kappa (fidelity), coverage (pass@n), mixed probability, in log space;
* `allocation`: the waterline allocation `allocate` -> `Allocation`;
* `estimators`: advantages, their exact expected scales, the policy loss;
* `success`: estimates of log p (oracle, historical discounted Beta, pilot);
* `validation`: the argument checks of every public boundary.

These modules import jax, numpy and chex only: nothing of the settings, the
shared pieces or the harness.
"""
