"""Held-out pass@k and exact-gradient alignment of SERA, SERA on exact p, uniform MaxRL and GRPO
on multi-digit addition, through Tunix.

For each seed, a small Qwen2 decoder (Tunix's model class) is warm-started by
supervised steps on a warm-start set of problems, then trained by RL inside
Tunix with `SeraLearner` at the same rollout budget B = M * N0 a step for
every arm: `sera` (SERA's counts on the historical estimate of p, MaxRL),
`sera-exact` (SERA's counts on the exact, teacher-forced p), `uniform` (N0
each, MaxRL) and `grpo` (N0 each, the MaxRL paper's GRPO). Every `align_every`
steps each arm logs the cosines with the exact likelihood gradient of its
realized gradient, of its expected gradient and of uniform MaxRL's, and the
exact mean log p of its batch (`SeraLearner.alignment`).

Each arm trains at its own learning rate, chosen from a grid by pass@1 on
validation problems (disjoint from every other set, drawn like the training
problems) with seeds of its own; the held-out problems are used only for the
figure. Held-out pass@k (k = 1, 2, ..., 256, unbiased, from 256 samples a
problem) is measured after the warm start and after RL. The seed sets the
initialisation, the warm-start batches, the data order and the rollouts; the
problems are the same for every seed.

  sera-jax figure math            # 4 arms x 10 seeds, after the learning-rate search
  sera-jax figure math --tiny     # a smoke run (seconds a run)

The experiment is the shipped config `math` (sera_jax/harness/configs/math.py).
Writes math_passk.{png,csv} (pass@k per seed, paired differences),
math_alignment.{png,csv} (every seed's logged steps) and math_tuning.csv (the
validation grid, when it has more than one rate) into --out. Each finished run
leaves its scores in --workdir (one JSON per run), which a rerun of the same
settings reuses. Needs the [llm] extra (google-tunix).
"""

import functools
import itertools
import json
import sys
import textwrap

import jax
import numpy as np
import optax

from sera_jax.common import evaluation, files
from sera_jax.common.plots import plt, save_figure
from sera_jax.harness import configs
from sera_jax.harness.figures import common

NAME, ALIGNMENT, TUNING = "math_passk", "math_alignment", "math_tuning"
CPU_COST = "about 40 min"  # on a 2-core CPU (`sera-jax figure --list`)
PASS_AT_K = tuple(2**i for i in range(9))  # 1, 2, 4, ..., 256
WARM_START = "warm start"
# name: (config.method, config.estimator, where a batch's log p comes from)
METHODS = {"sera": ("sera", "maxrl", "historical"), "sera-exact": ("sera", "maxrl", "exact"),
           "uniform": ("uniform", "maxrl", "historical"), "grpo": ("uniform", "grpo", "historical")}
ARM_KEYS = ("method", "estimator")  # the keys each arm sets; the rest is the config's
ALIGNED = ("cos/realized", "cos/expected", "cos/uniform_expected", "exact_log_p/mean")
REPORTED_K = (1, 16, 256)


def load_config(tiny: bool = False):
  """The shipped config `math`, or (tiny) its smoke-run size."""
  config = configs.load("math")
  if tiny:
    config.update(dict(warm_start_problems=256, train_problems=32, validation_problems=8,
                       held_out_problems=8, warm_start_steps=20, batch_size=8, baseline_n=4,
                       n_max=16, rl_steps=8, align_every=4, learning_rates=(1e-3,),
                       validation_samples=16))
  return config


def _decoder(config, seed: int):
  from sera_jax.settings.llm import tiny
  return tiny.decoder(seed, **config.model_kwargs)


def _pass_at_k(model, problems, num_samples: int, key: jax.Array) -> list[float]:
  from sera_jax.settings.llm import arithmetic
  successes = arithmetic.sample_successes(model, problems, num_samples=num_samples, key=key)
  return evaluation.pass_at_k(successes, num_samples,
                              [k for k in PASS_AT_K if k <= num_samples]).tolist()


def warm_start(config, problems, seed: int):
  """The warm-started decoder of `seed` (shared by every arm) and its held-out pass@k."""
  from sera_jax.settings.llm import arithmetic
  model = _decoder(config, seed)
  arithmetic.warm_start(model, problems["warm_start"], steps=config.warm_start_steps,
                        batch_size=config.warm_start_batch_size,
                        learning_rate=config.warm_start_learning_rate, seed=seed)
  return model, _pass_at_k(model, problems["held_out"], config.eval_samples,
                           jax.random.PRNGKey(10_000 + seed))


def reinforce(config, problems, warm_model, method: str, seed: int, learning_rate: float, *,
              evaluate_on: str = "held_out") -> dict:
  """RL from the warm start with `method` through Tunix at `learning_rate`.

  Returns:
    pass_at_k on the `evaluate_on` problems ("held_out", or "validation" with
    config.validation_samples a problem), the alignment logged every
    config.align_every steps ({"step": [...], name: [...] for ALIGNED}) and the
    last batch's counts.
  """
  from flax import nnx

  from sera_jax.settings.llm import arithmetic, learner, tiny
  from sera_jax.settings.llm import cluster as cluster_lib
  from sera_jax.settings.llm import config as llm_config
  actor = _decoder(config, seed)
  nnx.update(actor, nnx.state(warm_model, nnx.Param))
  cluster = cluster_lib.build(actor, arithmetic.TOKENIZER, tiny.mesh(),
                              optimizer=optax.adam(learning_rate), max_steps=config.rl_steps,
                              rollout_config=arithmetic.rollout_config(config.digits))
  arm_method, estimator, log_p_source = METHODS[method]
  arm = config.copy_and_resolve_references()
  arm.update(method=arm_method, estimator=estimator)
  sera = learner.SeraLearner(
      cluster, llm_config.sera_config(
          arm, dataset_size=config.train_problems, rollout_seed=seed,
          exact_log_p=arithmetic.batch_log_p,
          log_p_source=arithmetic.batch_log_p if log_p_source == "exact" else "historical"),
      arithmetic.exact_reward)
  batches = itertools.islice(
      learner.epoch_batches(problems["train"].columns(), config.batch_size, seed),
      config.rl_steps)
  with jax.set_mesh(tiny.mesh()):
    sera.train(batches)
  logged = cluster.actor_trainer.metrics_logger
  alignment = {name: [float(v) for v in logged.get_metric_history(*name.split("/"), "train")]
               for name in ALIGNED}
  alignment["step"] = list(range(1, config.rl_steps + 1, config.align_every))
  samples = config.eval_samples if evaluate_on == "held_out" else config.validation_samples
  return {"pass_at_k": _pass_at_k(cluster.actor_trainer.model, problems[evaluate_on], samples,
                                  jax.random.PRNGKey(20_000 + seed)),
          "alignment": alignment, "last_counts": sera.last_counts.tolist()}


def _cached(path, settings: dict, compute) -> dict:
  """The JSON at `path` if it was made with `settings`, else `compute()` written there."""
  if path.exists():
    saved = json.loads(path.read_text())
    if saved["config"] != settings:
      raise SystemExit(f"error: {path} holds a run of other settings; give another --workdir.")
    return saved
  result = {"config": settings, **compute()}
  files.write_text(path, json.dumps(result))
  return result


def _run_settings(config, method: str | None = None, learning_rate: float | None = None) -> dict:
  """What a run's result depends on: the experiment (less the search grid and the keys its arm
  sets) and its rate."""
  settings = {key: value for key, value in config.to_dict().items()
              if key not in ("learning_rates", "tuning_seeds", *ARM_KEYS)}
  settings["model"] = settings.pop("model_kwargs")  # the name the cached runs record
  return settings if method is None else {**settings, "method": method,
                                          "learning_rate": learning_rate}


def choose_learning_rates(config, problems, methods, workdir, warm_started, out_csv: str):
  """Each arm's rate: the best mean validation pass@1 over config.tuning_seeds (ties: the
  smaller rate). Writes every (arm, rate, seed) validation pass@k to `out_csv`.

  A grid of one rate has nothing to choose: it trains no tuning run and writes no `out_csv`.
  """
  if len(config.learning_rates) == 1:
    (rate,) = config.learning_rates
    print(f"one learning rate, {rate:g}: no tuning runs", flush=True)
    return {method: rate for method in methods}
  rows, chosen = [], {}
  for method in methods:
    scores = {}
    for rate in config.learning_rates:
      per_seed = []
      for seed in config.tuning_seeds:
        result = _cached(
            workdir / f"tune-{method}-lr{rate:g}-seed{seed}.json",
            _run_settings(config, method, rate),
            lambda m=method, r=rate, s=seed: reinforce(config, problems, warm_started(s)[0], m,
                                                       s, r, evaluate_on="validation"))
        per_seed.append(result["pass_at_k"])
        rows.append({"method": method, "learning_rate": rate, "seed": seed,
                     **{f"pass@{k}": f"{v:.4f}"
                        for k, v in zip(PASS_AT_K, result["pass_at_k"], strict=False)}})
      scores[rate] = float(np.mean([values[0] for values in per_seed]))
    chosen[method] = common.choose_rate(scores)
    print(f"{method}: validation pass@1 " + ", ".join(
        f"{rate:g} -> {score:.4f}" for rate, score in scores.items())
          + f"; chosen {chosen[method]:g}", flush=True)
  files.write_csv(out_csv, rows)
  return chosen


def alignment_rows(runs, seeds) -> list[dict]:
  """One CSV row per (arm, seed, logged step) with every ALIGNED value."""
  return [{"method": method, "seed": seed, "step": step,
           **{name: f"{run[seed]['alignment'][name][i]:.5f}" for name in ALIGNED}}
          for method, run in runs.items() for seed in seeds
          for i, step in enumerate(run[seed]["alignment"]["step"])]


def mean_over_training(runs, seeds, name: str) -> dict[str, np.ndarray]:
  """{arm: [S] each seed's mean of `name` over its logged steps}."""
  return {method: np.array([np.mean(run[s]["alignment"][name]) for s in seeds])
          for method, run in runs.items()}


def alignment_table(runs, seeds) -> str:
  """Mean cosines over training per arm (mean ± 95% interval over seeds), then paired."""
  lines = ["| arm | cos realized | cos expected | cos uniform expected | exact mean log p |",
           "|---|---|---|---|---|"]
  means = {name: mean_over_training(runs, seeds, name) for name in ALIGNED}
  for method in runs:
    cells = [f"{m:.3f} ± {h:.3f}" for m, h in
             (common.mean_interval(means[name][method]) for name in ALIGNED)]
    lines.append(f"| {method} | {' | '.join(cells)} |")
  lines += ["", "paired by seed, mean and 95% interval:", "| difference | cos realized | "
            "cos expected |", "|---|---|---|"]
  for arm, baseline in (("sera", "uniform"), ("sera-exact", "sera"), ("sera-exact", "uniform"),
                        ("grpo", "uniform")):
    if arm in runs and baseline in runs:
      cells = [f"{m:+.3f} ± {h:.3f}" for m, h in
               (common.mean_interval(means[name][arm] - means[name][baseline])
                for name in ALIGNED[:2])]
      lines.append(f"| {arm} − {baseline} | {' | '.join(cells)} |")
  return "\n".join(lines)


def plot_alignment(runs, seeds, path: str, title: str) -> None:
  """Per arm, mean over seeds with a 95% band over training: the realized and expected
  cosines with the exact gradient, and the exact mean log p of the training batch."""
  panels = (("cos/realized", "cos(realized, exact)"), ("cos/expected", "cos(expected, exact)"),
            ("exact_log_p/mean", "exact mean log p of the batch"))
  fig, axes = plt.subplots(1, len(panels), figsize=(14, 4))
  for axis, (name, label) in zip(axes, panels, strict=True):
    for method, run in runs.items():
      steps = run[seeds[0]]["alignment"]["step"]
      values = np.array([run[s]["alignment"][name] for s in seeds])
      mean, half = common.mean_interval(values, axis=0)
      axis.plot(steps, mean, label=method)
      axis.fill_between(steps, mean - half, mean + half, alpha=0.2)
    axis.set(xlabel="RL step", ylabel=label)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
  fig.suptitle(textwrap.fill(title, 170), fontsize=9)
  fig.tight_layout()
  save_figure(fig, path, dpi=120)


def difference_table(results, seeds) -> str:
  """SERA − uniform, SERA-exact − SERA (and the rest against uniform) at REPORTED_K."""
  columns = [PASS_AT_K.index(k) for k in REPORTED_K]
  paired = {**common.paired_differences(results, seeds, exclude=(WARM_START,)),
            **{name: diff for name, diff in common.paired_differences(
                results, seeds, baseline="sera", exclude=(WARM_START, "uniform", "grpo")).items()}}
  lines = [f"| difference | {' | '.join(f'pass@{k}' for k in REPORTED_K)} |",
           f"|---|{'---|' * len(REPORTED_K)}"]
  for name, diff in paired.items():
    mean, half = common.mean_interval(diff[:, columns], axis=0)
    cells = " | ".join(f"{m:+.3f} ± {h:.3f}" for m, h in zip(mean, half, strict=True))
    lines.append(f"| {name.replace(' - ', ' − ')} | {cells} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = common.figure_parser("math", __doc__)
  parser.add_argument("--tiny", action="store_true", help="a small smoke run")
  parser.add_argument("--seeds", type=int, default=10)
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  parser.add_argument("--workdir", default=None, help="default runs/math_passk[_tiny]")
  argv = sys.argv[1:] if argv is None else argv
  args = parser.parse_args(argv)
  try:
    from sera_jax.settings.llm import arithmetic
  except ImportError as error:
    raise SystemExit(f"error: sera-jax figure math needs the [llm] extra "
                     f"(pip install -e '.[llm]'): {error}") from None
  config = load_config(args.tiny)
  stem = "_tiny" * args.tiny
  workdir = files.path(args.workdir or f"runs/{NAME}{stem}")
  problems = arithmetic.split({"warm_start": config.warm_start_problems,
                               "train": config.train_problems,
                               "validation": config.validation_problems,
                               "held_out": config.held_out_problems}, digits=config.digits)
  figure_run = common.start_figure()
  # A seed's warm start, built once and only when a run of that seed is not cached.
  warm_started = functools.lru_cache(maxsize=None)(
      lambda seed: warm_start(config, problems, seed))
  png, csv = common.output_paths(args.out, NAME + stem)
  learning_rates = choose_learning_rates(config, problems, args.methods, workdir, warm_started,
                                         common.output_paths(args.out, TUNING + stem)[1])
  print(f"learning rates chosen on validation problems ({figure_run.elapsed():.0f} s)")
  seeds = list(range(args.seeds))
  results = {WARM_START: {}} | {method: {} for method in args.methods}
  runs = {method: {} for method in args.methods}
  for seed in seeds:
    results[WARM_START][seed] = _cached(
        workdir / f"warm-seed{seed}.json", _run_settings(config),
        lambda seed=seed: {"pass_at_k": warm_started(seed)[1]})["pass_at_k"]
    for method in args.methods:
      rate = learning_rates[method]
      run = _cached(workdir / f"{method}-seed{seed}.json", _run_settings(config, method, rate),
                    lambda method=method, seed=seed, rate=rate: reinforce(
                        config, problems, warm_started(seed)[0], method, seed, rate))
      runs[method][seed], results[method][seed] = run, run["pass_at_k"]
      print(f"seed {seed} {method}: pass@1 {run['pass_at_k'][0]:.3f}  "
            f"pass@256 {run['pass_at_k'][-1]:.3f}  ({figure_run.elapsed():.0f} s)", flush=True)
  rates = ", ".join(f"{m} {r:g}" for m, r in learning_rates.items())
  setting = (f"{config.digits}-digit addition, 2-layer Qwen2 in Tunix; B = {config.batch_size} x "
             f"{config.baseline_n} rollouts/step (SERA n in [{config.n_min}, {config.n_max}]), "
             f"{config.rl_steps} RL steps on {config.train_problems} problems, {len(seeds)} "
             f"seeds; Adam at {rates} (chosen on validation problems)")
  common.write_pass_at_k_csv(results, seeds, PASS_AT_K, csv, exclude=(WARM_START,))
  common.plot_pass_at_k(
      results, seeds, PASS_AT_K, png, what="held-out problems", exclude=(WARM_START,),
      styles={WARM_START: dict(linestyle="--", color="gray")},
      title=textwrap.fill(f"{setting}; {config.held_out_problems} held-out problems x "
                          f"{config.eval_samples} samples", 130))
  alignment_png, alignment_csv = common.output_paths(args.out, ALIGNMENT + stem)
  files.write_csv(alignment_csv, alignment_rows(runs, seeds))
  plot_alignment(runs, seeds, alignment_png,
                 title=f"{setting}; cosines with the exact gradient every "
                 f"{config.align_every} steps (mean, 95% band over seeds)")
  print(common.pass_at_k_tables(results, seeds, PASS_AT_K, exclude=(WARM_START,)))
  print("\n" + difference_table(results, seeds))
  print("\nmean over training:\n" + alignment_table(runs, seeds))
  protocol = {key: config[key] for key in (
      "digits", "warm_start_problems", "train_problems", "validation_problems",
      "held_out_problems", "eval_samples", "batch_size", "baseline_n", "n_min", "n_max",
      "rl_steps")}
  manifest = common.write_manifest(
      args.out, NAME + stem, figure_run, command="figure math", argv=argv, seeds=seeds,
      tuning_seeds=list(config.tuning_seeds),
      protocol=protocol | {"learning_rates": {"grid": list(config.learning_rates),
                                              "chosen": learning_rates}})
  print(f"total {figure_run.elapsed():.0f} s; wrote {png}, {csv}, {alignment_png}, "
        f"{alignment_csv} and {manifest}")
