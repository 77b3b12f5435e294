"""Classification as RL (docs/method.md#classification-as-rl): a sampled label is a rollout.

* `gradients`: exact-in-law rollout sampling, the exact / realized / expected
  logit cotangents and their cosines;
* `alignment`: the methods the figures compare and one jitted evaluator of
  their alignment with the exact gradient;
* `task`: the training task (`ClassificationTask`);
* `batched`: runs that differ in seed and optimizer scalars trained as one vmapped program;
* `plots`: the alignment figure of a run.
"""
