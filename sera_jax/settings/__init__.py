"""The settings: one folder each, built on the method and the shared pieces.

* `classification`: classification as RL (docs/method.md#classification-as-rl), where the exact
  likelihood gradient is the cross-entropy gradient;
* `maze`: maze navigation with a transformer policy.

A setting imports the method and `sera_jax.common`, never the harness or
another setting.
"""
