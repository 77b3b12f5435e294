"""Held-out pass@k of SERA, uniform MaxRL and GRPO on multi-digit addition, through Tunix.

For each seed, a small Qwen2 decoder (Tunix's model class) is warm-started by
supervised steps on a warm-start set of problems, then trained by RL inside
Tunix with `SeraLearner` at the same rollout budget B = M * N0 a step for
every method: `sera` (SERA's counts, MaxRL), `uniform` (N0 each, MaxRL) and
`grpo` (N0 each, the MaxRL paper's GRPO). Held-out pass@k (k = 1, 2, ..., 256,
unbiased, from 256 samples a problem) is measured after the warm start and
after RL. The problem sets (`sera_jax.settings.llm.arithmetic`) are the same
for every seed; the seed sets the initialisation, the warm-start batches and
the rollouts.

  sera-jax figure math            # 3 methods x 5 seeds on this CPU
  sera-jax figure math --tiny     # a smoke run (seconds a run)

Writes math_passk.png and math_passk.csv (mean, std, 95% interval and every
seed's value, and the paired differences to uniform) into --out. Each finished
run leaves its scores in --workdir (one JSON per run), which a rerun of the
same settings reuses. Needs the [llm] extra (google-tunix).
"""

import functools
import itertools
import json
import time

import jax
import ml_collections
import optax

from sera_jax.common import evaluation, files
from sera_jax.harness.figures import common

NAME = "math_passk"
PASS_AT_K = tuple(2**i for i in range(9))  # 1, 2, 4, ..., 256
WARM_START = "warm start"
METHODS = {"sera": ("sera", "maxrl"), "uniform": ("uniform", "maxrl"),
           "grpo": ("uniform", "grpo")}  # name: (allocation, estimator)


def get_config(tiny: bool = False) -> ml_collections.ConfigDict:
  """The experiment: problem sets, decoder, warm start, RL budget and evaluation."""
  config = ml_collections.ConfigDict(dict(
      digits=3, warm_start_problems=2048, train_problems=1024, held_out_problems=128,
      model=dict(num_layers=2, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16),
      warm_start_steps=800, warm_start_batch_size=128, warm_start_learning_rate=3e-3,
      batch_size=32, baseline_n=8, n_min=2, n_max=32, rl_steps=256, learning_rate=3e-4,
      eval_samples=256))
  if tiny:
    config.update(dict(warm_start_problems=256, train_problems=32, held_out_problems=8,
                       warm_start_steps=20, batch_size=8, baseline_n=4, n_max=16, rl_steps=8))
  return config


def _decoder(config, seed: int):
  from sera_jax.settings.llm import tiny
  return tiny.decoder(seed, **config.model)


def _held_out_pass_at_k(config, model, held_out, seed: int) -> list[float]:
  from sera_jax.settings.llm import arithmetic
  successes = arithmetic.sample_successes(model, held_out, num_samples=config.eval_samples,
                                          key=jax.random.PRNGKey(10_000 + seed))
  return evaluation.pass_at_k(successes, config.eval_samples, PASS_AT_K).tolist()


def warm_start(config, problems, seed: int):
  """The warm-started decoder of `seed` (shared by every method) and its held-out pass@k."""
  from sera_jax.settings.llm import arithmetic
  model = _decoder(config, seed)
  arithmetic.warm_start(model, problems["warm_start"], steps=config.warm_start_steps,
                        batch_size=config.warm_start_batch_size,
                        learning_rate=config.warm_start_learning_rate, seed=seed)
  return model, _held_out_pass_at_k(config, model, problems["held_out"], seed)


def reinforce(config, problems, warm_model, method: str, seed: int) -> dict:
  """RL from the warm start with `method` through Tunix; returns the run's scores."""
  from flax import nnx

  from sera_jax.settings.llm import arithmetic, learner, tiny
  from sera_jax.settings.llm import cluster as cluster_lib
  actor = _decoder(config, seed)
  nnx.update(actor, nnx.state(warm_model, nnx.Param))
  cluster = cluster_lib.build(actor, arithmetic.TOKENIZER, tiny.mesh(),
                              optimizer=optax.adam(config.learning_rate),
                              max_steps=config.rl_steps,
                              rollout_config=arithmetic.rollout_config(config.digits))
  allocation, estimator = METHODS[method]
  sera = learner.SeraLearner(
      cluster, learner.SeraConfig(num_generations=config.baseline_n, n_min=config.n_min,
                                  n_max=config.n_max, dataset_size=config.train_problems,
                                  allocation=allocation, estimator=estimator,
                                  rollout_seed=seed),
      arithmetic.exact_reward)
  batches = itertools.islice(
      learner.epoch_batches(problems["train"].columns(), config.batch_size, seed),
      config.rl_steps)
  with jax.set_mesh(tiny.mesh()):
    sera.train(batches)
  return {"pass_at_k": _held_out_pass_at_k(config, cluster.actor_trainer.model,
                                           problems["held_out"], seed),
          "last_counts": sera.last_counts.tolist()}


def _cached(path, config, compute) -> dict:
  """The JSON at `path` if it was made with `config`, else `compute()` written there."""
  settings = config.to_dict()
  if path.exists():
    saved = json.loads(path.read_text())
    if saved["config"] != settings:
      raise SystemExit(f"error: {path} holds a run of other settings; give another --workdir.")
    return saved
  result = {"config": settings, **compute()}
  files.write_text(path, json.dumps(result))
  return result


def main(argv: list[str] | None = None) -> None:
  parser = common.figure_parser("math", __doc__)
  parser.add_argument("--tiny", action="store_true", help="a small smoke run")
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  parser.add_argument("--workdir", default=None, help="default runs/math_passk[_tiny]")
  args = parser.parse_args(argv)
  try:
    from sera_jax.settings.llm import arithmetic
  except ImportError as error:
    raise SystemExit(f"error: sera-jax figure math needs the [llm] extra "
                     f"(pip install -e '.[llm]'): {error}") from None
  config = get_config(args.tiny)
  stem = NAME + "_tiny" * args.tiny
  workdir = files.path(args.workdir or f"runs/{stem}")
  problems = arithmetic.split({"warm_start": config.warm_start_problems,
                               "train": config.train_problems,
                               "held_out": config.held_out_problems}, digits=config.digits)
  seeds = list(range(args.seeds))
  results = {WARM_START: {}} | {method: {} for method in args.methods}
  start = time.time()
  # A seed's warm start, built once and only when a run of that seed is not cached.
  warm_started = functools.lru_cache(maxsize=1)(
      lambda seed: warm_start(config, problems, seed))
  for seed in seeds:
    results[WARM_START][seed] = _cached(
        workdir / f"warm-seed{seed}.json", config,
        lambda seed=seed: {"pass_at_k": warm_started(seed)[1]})["pass_at_k"]
    for method in args.methods:
      def run(method=method, seed=seed):
        return reinforce(config, problems, warm_started(seed)[0], method, seed)

      scores = _cached(workdir / f"{method}-seed{seed}.json", config, run)["pass_at_k"]
      results[method][seed] = scores
      print(f"seed {seed} {method}: pass@1 {scores[0]:.3f}  pass@256 {scores[-1]:.3f}  "
            f"({time.time() - start:.0f} s)", flush=True)
  png, csv = common.output_paths(args.out, stem)
  common.write_pass_at_k_csv(results, seeds, PASS_AT_K, csv, exclude=(WARM_START,))
  common.plot_pass_at_k(
      results, seeds, PASS_AT_K, png, what="held-out problems", exclude=(WARM_START,),
      styles={WARM_START: dict(linestyle="--", color="gray")},
      title=f"{config.digits}-digit addition, 2-layer Qwen2 in Tunix; B = {config.batch_size} x "
      f"{config.baseline_n} rollouts/step (SERA n in [{config.n_min}, {config.n_max}]), "
      f"{config.rl_steps} RL steps on {config.train_problems} problems, {len(seeds)} seeds; "
      f"{config.held_out_problems} held-out problems x {config.eval_samples} samples")
  print(common.pass_at_k_tables(results, seeds, PASS_AT_K, exclude=(WARM_START,)))
  print(f"total {time.time() - start:.0f} s; wrote {png} and {csv}")
