"""Held-out pass@k over simulated scenarios: SERA, uniform MaxRL and GRPO in MuJoCo MJX.

The MJX point-mass navigation task (`--config sim_nav`, `sera_jax.settings.sim.point_mass`)
from scratch: every method spends the same budget of B = M * N0 episodes a step on a fixed
set of training scenarios, each at its own Adam rate, chosen from --learning-rates by mean
validation pass@8 (fresh validation scenarios) over the tuning seeds 100, 101, ..., which are
never reported; the reported seeds train at the chosen rate and are scored on i.i.d.
held-out scenarios (pass@k for k = 1 ... eval_samples, unbiased). A seed sets the policy's
initialisation, the batch order and the episodes' actions; the scenarios are shared.

Before RL the figure measures the initial policy's success rate on every training scenario
(seed 0's initialisation): its spread is what SERA allocates over. Beside held-out pass@k it
reports the share of each step's episodes spent on scenarios whose estimated p is below 0.1
(`budget/hard_fraction`, mean over the run).

  sera-jax figure sim                 # 3 methods x (6 rates x 2 tuning seeds + 10 seeds)
  sera-jax figure sim --tiny          # a smoke run of the pipeline

Writes sim_passk.png / .csv (every seed, the paired differences to uniform), sim_budget.csv
(each run's hard-scenario share), sim_passk_rates.png / .csv (the whole grid) and
sim_passk.manifest.json into --out (default docs/figures/sim), and one workdir per run under
--workdir (a run of the same config is read back, so a killed figure resumes).
"""

import os
import sys

import jax
import numpy as np

from sera_jax.common import files
from sera_jax.harness import configs, train
from sera_jax.harness.figures import common
from sera_jax.settings.sim import task as sim_task

NAME = "sim_passk"
CPU_COST = "about 30 min"  # on a 2-core CPU (`sera-jax figure --list`)
OUT_DIR = os.path.join(common.OUT_DIR, "sim")
LEARNING_RATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
CHOSEN_BY = 8  # the rate of the best validation pass@8
INITIAL_SAMPLES = 64  # episodes of each training scenario that measure the initial p


def load_config(tiny: bool):
  config = configs.load("sim_nav")
  config.update(dict(batch_size=16, num_train_scenarios=256, num_steps=400))
  if tiny:  # a smoke run of the pipeline
    config.update(dict(environment="one_step", hidden_sizes=(8,), num_train_scenarios=16,
                       batch_size=4, baseline_n=4, n_max=8, num_validation_scenarios=8,
                       num_eval_scenarios=8, eval_samples=8, eval_batch_size=8, num_steps=8))
  config.eval_every = config.checkpoint_every = config.num_steps  # one evaluation, at the end
  return config


def initial_spread(task: sim_task.SimTask) -> dict:
  """Quantiles of the initial policy's (seed 0's) success rate over the training scenarios."""
  params = task.init_state(jax.random.PRNGKey(0)).params
  p = task.success_rates(params, "train", np.arange(task.sets["train"].size), INITIAL_SAMPLES,
                         jax.random.PRNGKey(1))
  levels = [0, 0.25, 0.5, 0.75, 0.9, 1]
  return {"samples_per_scenario": INITIAL_SAMPLES,
          **dict(zip(("min", "q25", "median", "q75", "q90", "max"),
                     np.quantile(p, levels).round(4).tolist(), strict=True)),
          "fraction_0": round(float(np.mean(p == 0)), 4)}


def hard_share(tuned: dict[str, common.TunedRuns], seeds, workdir) -> list[dict]:
  """Each reported run's share of episodes on hard scenarios, mean over its steps."""
  rows = []
  for method, runs in tuned.items():
    for seed in seeds:
      metrics = train.read_metrics(common.method_run_dir(workdir, method, runs.rate, seed))
      rows.append({"method": method, "seed": seed, "learning_rate": runs.rate,
                   "hard_fraction": round(float(np.mean([
                       row["budget/hard_fraction"] for row in metrics
                       if "budget/hard_fraction" in row])), 4)})
  return rows


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  parser = common.figure_parser("sim", __doc__)
  parser.set_defaults(out=OUT_DIR)
  common.add_method_grid(parser, LEARNING_RATES)
  parser.add_argument("--workdir", default=None, help="default runs/sim_passk[_tiny]")
  args = parser.parse_args(argv)
  seeds, tuning_seeds = common.method_grid_seeds(parser, args)
  workdir = files.path(args.workdir or "runs/" + NAME + "_tiny" * args.tiny)
  config = load_config(args.tiny)
  figure_run = common.start_figure()
  task = sim_task.SimTask(config)
  spread = initial_spread(task)
  print(f"before RL: the initial policy's p over the {config.num_train_scenarios} training "
        f"scenarios: {spread}", flush=True)
  tuned = common.tune_methods(config, args.methods, seeds, sorted(set(args.learning_rates)),
                              tuning_seeds, workdir, figure_run, chosen_by=CHOSEN_BY,
                              one_by_one=args.one_by_one)
  ks = task.ks
  stem = NAME + "_tiny" * args.tiny
  results = {method: {seed: [row.get(f"pass@{k}", np.nan) for k in ks]
                      for seed, row in runs.runs.items()} for method, runs in tuned.items()}
  png, csv = common.output_paths(args.out, stem)
  common.write_pass_at_k_csv(results, seeds, ks, csv)
  rates = ", ".join(f"{method} {runs.rate:g}" for method, runs in tuned.items())
  common.plot_pass_at_k(
      results, seeds, ks, png, what="held-out scenarios",
      title=f"{config.environment}: B = {config.batch_size} x {config.baseline_n} episodes/step, "
      f"{config.num_steps} steps on {config.num_train_scenarios} scenarios from scratch, "
      f"{len(seeds)} seeds, Adam at {rates} (chosen on validation); "
      f"{config.num_eval_scenarios} i.i.d. held-out scenarios")
  print("held-out scenarios:\n" + common.pass_at_k_tables(results, seeds, ks))
  for method in tuned:
    if method != "uniform" and "uniform" in tuned:
      print(common.seeds_ahead(results, seeds, ks, method))
  budget_csv = os.fspath(files.path(args.out) / f"{stem.replace('passk', 'budget')}.csv")
  files.write_csv(budget_csv, hard_share(tuned, seeds, workdir))
  rates_png, rates_csv = common.output_paths(args.out, stem + "_rates")
  common.write_validation_grid_csv(tuned, ks, rates_csv)
  common.plot_validation_grid(
      tuned, rates_png, ylabel=f"validation pass@{CHOSEN_BY} (mean of {args.tuning_seeds} "
      f"seeds)", title=f"{config.environment}: each method's learning rate (star: chosen)")
  facts = {"environment": config.environment, "train_scenarios": config.num_train_scenarios,
           "validation_scenarios": config.num_validation_scenarios,
           "held_out_scenarios": config.num_eval_scenarios,
           "episodes_per_step": config.batch_size * config.baseline_n,
           "horizon": task.environment.horizon, "steps": config.num_steps,
           "epochs": config.num_steps * config.batch_size / config.num_train_scenarios,
           "samples_per_scenario": config.eval_samples, "initial_p": spread,
           "hard_p": sim_task.HARD_P, "learning_rates": common.rate_choices(tuned)}
  manifest = common.write_manifest(args.out, stem, figure_run, command="figure sim", argv=argv,
                                   seeds=seeds, tuning_seeds=tuning_seeds, protocol=facts)
  print(f"total {figure_run.elapsed():.0f} s; wrote {png}, {csv}, {budget_csv}, {rates_png}, "
        f"{rates_csv} and {manifest}")
