"""An experiment config's SERA keys as `SeraLearner`'s `SeraConfig`: the one place where the
key names every config shares (sera_jax/harness/configs) become Tunix's and the learner's.

`method` is SeraConfig.allocation and `baseline_n` (N0) Tunix's num_generations; the other
keys keep their names: the allocation's (docs/method.md#the-estimator-and-its-scale) and the
historical estimator's (docs/method.md#estimating-p).
"""

from collections.abc import Mapping
from typing import Any

from sera_jax.settings.llm import learner

# Experiment-config key -> SeraConfig field, for every key SeraConfig takes from a config.
FIELDS = {
    "method": "allocation",
    "baseline_n": "num_generations",
    **{key: key for key in ("estimator", "estimator_kwargs", "n_min", "n_max", "threshold",
                            "normalize_by_rollout_count", "normalize_by_rho", "discount",
                            "alpha0", "beta0", "rollout_seed", "generation_batch_size",
                            "align_every")},
}


def sera_config(config: Mapping[str, Any], *, dataset_size: int, **fields) -> learner.SeraConfig:
  """The learner's SeraConfig (validated when built) of `config` for `dataset_size` prompts.

  Args:
    config: an experiment config (a ConfigDict); each key of `FIELDS` it holds sets its
      field, and a key it lacks leaves SeraConfig's default.
    dataset_size: P, the training prompts.
    **fields: SeraConfig fields that no config key sets (e.g. log_p_source, exact_log_p, a
      rollout_seed drawn from the run's seed).

  Raises:
    TypeError: `fields` names a field that a config key sets (set the key instead).
  """
  by_key = sorted(key for key, field in FIELDS.items() if field in fields and key in config)
  if by_key:
    raise TypeError(f"set {', '.join(f'config.{key}' for key in by_key)} in the config, not "
                    f"as a SeraConfig field.")
  from_config = {field: config[key] for key, field in FIELDS.items() if key in config}
  return learner.SeraConfig(**from_config, **fields, dataset_size=dataset_size)
