"""A policy's pass@k, mean@n and greedy score on benchmark files (`sera-jax evaluate`).

Every problem of each benchmark (a problem file, `data.load`) gets n sampled completions at
config.temperature (top-p `top_p`) and one greedy completion, graded by the benchmark's grader
(`grading`; math-verify in `grading.MathGrader`'s worker processes). The policy is the one the
config trains (`gsm8k.load_pretrained`): the pretrained weights of config.model_dir, or, when
config.checkpoint_dir is set, the actor that training saved there (its latest step or
`step`). Completions come from Tunix's vanilla sampler, as training generates them: on the mesh
of config.mesh_shape, config.generation_batch_size at a time, stopping at EOS or a stop token.

Written into the output directory (local or gs://), from the pure functions below:

* pass_at_k.csv: a row a benchmark: its problems, n, the greedy accuracy, mean@n (the mean
  accuracy of the samples) and pass@k for k = 1, 2, 4, ..., n, the unbiased estimator
  1 - C(n - c, k) / C(n, k) averaged over problems (`sera_jax.common.evaluation.pass_at_k`),
  and the answers graded 0 because grading failed (`grading.MathGrader`);
* pass_at_k.png: pass@k against k, a curve a benchmark, its greedy accuracy marked at k = 1;
* samples.jsonl: every completion, its reference and its verdict: what the scores are
  computed from.
"""

import contextlib
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import tqdm
from etils import epath
from flax import nnx
from tunix.rl.rollout import base_rollout, vanilla_rollout
from tunix.sft import checkpoint_manager

from sera_jax.common import evaluation, files, plots
from sera_jax.settings.llm import data, grading, gsm8k, tunix_compat

CSV, PLOT, SAMPLES = "pass_at_k.csv", "pass_at_k.png", "samples.jsonl"


class Benchmark(NamedTuple):
  """A problem file to evaluate on, named in the outputs."""
  name: str
  format: str  # a key of data.FORMATS
  location: str


def parse_benchmark(spec: str) -> Benchmark:
  """A benchmark of `[NAME:]FORMAT=PATH`; NAME defaults to the file's name without suffix."""
  head, separator, location = spec.partition("=")
  if not separator or not location:
    raise ValueError(f"a benchmark is [NAME:]FORMAT=PATH (a format of "
                     f"{', '.join(data.FORMATS)}); got {spec!r}.")
  name, _, format_name = head.rpartition(":")
  return Benchmark(name or files.path(location).stem, format_name, location)


# ---- the scores (pure) --------------------------------------------------------------------


def ks(n: int) -> list[int]:
  """The k of pass@k for n samples a problem: 1, 2, 4, ... up to n, and n."""
  return sorted({2**i for i in range(n.bit_length())} | {n})


def scores(correct: np.ndarray, greedy: np.ndarray | None = None) -> dict[str, Any]:
  """A benchmark's scores from its verdicts.

  Args:
    correct: bool [P, n]: sample j of problem i is right.
    greedy: bool [P]: the greedy completion of problem i is right (None: not scored).

  Returns:
    {"problems": P, "samples": n, "greedy": accuracy (when given), "mean@n": the mean of
    `correct`, "pass@k": the unbiased pass@k averaged over problems, for each k of `ks(n)`}.
  """
  correct = np.asarray(correct, bool)
  problems, n = correct.shape
  row = {"problems": problems, "samples": n}
  if greedy is not None:
    row["greedy"] = float(np.mean(greedy))
  row[f"mean@{n}"] = float(np.mean(correct))
  passes = evaluation.pass_at_k(correct.sum(axis=1), n, ks(n))
  return row | {f"pass@{k}": float(value) for k, value in zip(ks(n), passes, strict=True)}


def write_results(out: epath.PathLike, rows: Sequence[dict[str, Any]],
                  samples: Sequence[dict[str, Any]], *, title: str) -> None:
  """Writes pass_at_k.csv (`rows`, a benchmark each), its plot and samples.jsonl into `out`."""
  out = files.path(out)
  files.write_csv(out / CSV, rows)
  files.write_text(out / SAMPLES, "".join(json.dumps(sample) + "\n" for sample in samples))
  fig, ax = plots.plt.subplots(figsize=(6, 4))
  for row in rows:
    k = [int(key.removeprefix("pass@")) for key in row if key.startswith("pass@")]
    line, = ax.plot(k, [row[f"pass@{i}"] for i in k], marker="o", label=row["benchmark"])
    if "greedy" in row:
      ax.plot([1], [row["greedy"]], marker="x", markersize=9, color=line.get_color(),
              linestyle="none")
  ax.set_xscale("log", base=2)
  ax.set(xlabel="k", ylabel="pass@k", ylim=(0, 1.02), title=title)
  ax.legend(title="x: greedy", fontsize="small")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  plots.save_figure(fig, out / PLOT, dpi=150)


# ---- the policy and its completions -------------------------------------------------------


def load_policy(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, *,
                step: int | None = None) -> tuple[nnx.Module, Any, int | None]:
  """(model, tokenizer, step) of the config: config.model_dir's weights (step None), or, when
  config.checkpoint_dir is set, the actor training saved there at `step` (default its latest).

  Raises:
    ValueError: a step without config.checkpoint_dir.
    FileNotFoundError: config.checkpoint_dir holds no actor checkpoint (or not `step`).
  """
  if not config.checkpoint_dir and step is not None:
    raise ValueError(f"step {step} is a step of a training run's checkpoints: set "
                     f"config.checkpoint_dir.")
  model, tokenizer = gsm8k.load_pretrained(config, mesh)
  if not config.checkpoint_dir:
    return model, tokenizer, None
  # Tunix's RLCluster keeps the actor's checkpoints under <checkpoint_dir>/actor, a folder a
  # step (Orbax names a step's folder by its number once the step is whole).
  root = files.path(config.checkpoint_dir) / "actor"
  steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []
  if not steps or (step is not None and step not in steps):
    at = "" if step is None else f" at step {step}"
    raise FileNotFoundError(f"config.checkpoint_dir {config.checkpoint_dir} holds no checkpoint "
                            f"of the actor{at} (its steps: {steps or 'none'}).")
  manager = checkpoint_manager.CheckpointManager(
      os.fspath(root), ocp.CheckpointManagerOptions(create=False, read_only=True))
  restored, _ = manager.maybe_restore(model, step=steps[-1] if step is None else step)
  return model, tokenizer, restored


def vanilla(model: nnx.Module, tokenizer, config: ml_collections.ConfigDict
            ) -> vanilla_rollout.VanillaRollout:
  """Tunix's vanilla rollout of `model`, its KV cache config.kv_cache_size, as the RLCluster of
  training builds it."""
  return vanilla_rollout.VanillaRollout(model, tokenizer, base_rollout.CacheConfig(
      cache_size=config.kv_cache_size, num_layers=model.config.num_layers,
      num_kv_heads=model.config.num_kv_heads, head_dim=model.config.head_dim))


def generate(rollout: base_rollout.BaseRollout, prompts: Sequence[str],
             rollout_config: base_rollout.RolloutConfig, *, chunk: int, key: jax.Array,
             progress: tqdm.tqdm) -> list[str]:
  """The completion of each prompt, `chunk` prompts at a time, the i-th chunk sampled with the
  key fold_in(key, i); the last chunk is filled up with its first prompt, so that every chunk
  runs the sampler compiled for the first."""
  completions = []
  for number, start in enumerate(range(0, len(prompts), chunk)):
    part = list(prompts[start:start + chunk])
    seeded = dataclasses.replace(rollout_config, seed=jax.random.fold_in(key, number))
    output = rollout.generate(part + part[:1] * (chunk - len(part)), seeded)
    completions.extend(output.text[:len(part)])
    progress.update(len(part))
  return completions


def evaluate(config: ml_collections.ConfigDict, benchmarks: Sequence[Benchmark],
             out: epath.PathLike, *, samples: int, greedy: bool = True, top_p: float = 1.0,
             seed: int = 0, step: int | None = None, grading_processes: int = 1,
             grading_deadline_s: float = 10.0) -> list[dict[str, Any]]:
  """Scores the config's policy on `benchmarks` and writes the outputs into `out`.

  Args:
    config: the keys of the shipped config `gsm8k_qwen3` (the model, its lengths, mesh and
      temperature, config.checkpoint_dir for a trained policy).
    benchmarks: the problem files, read (and checked) before the model loads.
    out: the output directory (local or gs://).
    samples: n, the sampled completions of each problem.
    greedy: also score one greedy completion a problem.
    top_p: the nucleus of the sampled completions.
    seed: the sampling key's seed; each benchmark, and within it each chunk, folds its own.
    step: the checkpoint step of config.checkpoint_dir (default its latest).
    grading_processes, grading_deadline_s: `grading.MathGrader`'s.

  Returns:
    The rows of pass_at_k.csv.
  """
  if samples < 1:
    raise ValueError(f"samples must be >= 1; got {samples}.")
  if config.temperature <= 0:
    raise ValueError(f"config.temperature must be > 0 for the sampled completions; got "
                     f"{config.temperature} (the greedy completion is scored anyway).")
  problems = [data.load(b.location, b.format) for b in benchmarks]
  mesh = gsm8k.make_mesh(config)
  model, tokenizer, restored = load_policy(config, mesh, step=step)
  columns = [data.columns(p, tokenizer, max_prompt_length=config.max_prompt_length,
                          enable_thinking=config.enable_thinking,
                          instruction=config.instruction or None) for p in problems]
  sampling = dataclasses.replace(
      gsm8k.rollout_config(config, gsm8k.stop_ids(tokenizer, config.stop_tokens)), top_p=top_p)
  # Tunix's sampler decodes greedily when it is given no top-p.
  argmax = dataclasses.replace(sampling, top_p=None)
  key = jax.random.PRNGKey(seed)
  rows, records = [], []
  total = sum(len(p.questions) * (samples + greedy) for p in problems)
  math = any(p.grader == "math" for p in problems)
  with contextlib.ExitStack() as stack:
    grader = (stack.enter_context(grading.MathGrader(grading_processes, grading_deadline_s))
              if math else None)
    progress = stack.enter_context(tqdm.tqdm(total=total, unit="completion"))
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(tunix_compat.without_remat(model))  # as training generates
    rollout = vanilla(model, tokenizer, config)
    for number, (benchmark, problem, column) in enumerate(zip(benchmarks, problems, columns,
                                                              strict=True)):
      progress.set_description(benchmark.name)
      chunk = min(config.generation_batch_size, len(problem.questions) * samples)
      sampled = generate(rollout, np.repeat(column["prompts"], samples), sampling, chunk=chunk,
                         key=jax.random.fold_in(key, 2 * number), progress=progress)
      references = np.repeat(problem.answers, samples).tolist()
      failures = grader.failures if grader else 0
      verdicts = _grade(grader, problem.grader, sampled, references)
      correct = verdicts.reshape(len(problem.questions), samples)
      records += _records(benchmark.name, problem, sampled, references, verdicts, samples)
      greedy_correct = None
      if greedy:
        chunk = min(config.generation_batch_size, len(problem.questions))
        best = generate(rollout, column["prompts"], argmax, chunk=chunk,
                        key=jax.random.fold_in(key, 2 * number + 1), progress=progress)
        greedy_correct = _grade(grader, problem.grader, best, problem.answers)
        records += _records(benchmark.name, problem, best, problem.answers, greedy_correct, 1,
                            greedy=True)
      rows.append({"benchmark": benchmark.name, "format": benchmark.format,
                   "checkpoint_step": "pretrained" if restored is None else restored,
                   **scores(correct, greedy_correct),
                   "grading_failures": (grader.failures if grader else 0) - failures})
  title = (f"{os.path.basename(config.model_dir.rstrip('/'))}, "
           f"{'pretrained' if restored is None else f'step {restored}'}")
  write_results(out, rows, records, title=title)
  return rows


def _grade(grader: grading.MathGrader | None, kind: str, completions: Sequence[str],
           references: Sequence[str]) -> np.ndarray:
  """bool [len(completions)]: each completion's verdict by the `kind` grader."""
  if kind == "math":
    return grader(completions, references).astype(bool)
  return np.array([grading.number_correct(c, r) for c, r in zip(completions, references,
                                                                  strict=True)], dtype=bool)


def _records(name: str, problems: data.Problems, completions: Sequence[str],
             references: Sequence[str], verdicts: np.ndarray, per_problem: int, *,
             greedy: bool = False) -> list[dict[str, Any]]:
  """samples.jsonl's lines of one benchmark's completions, `per_problem` a problem in order."""
  return [{"benchmark": name, "problem": int(problems.index[i // per_problem]),
           "sample": i % per_problem, "greedy": greedy, "reference": reference,
           "completion": completion, "correct": bool(verdict)}
          for i, (completion, reference, verdict) in enumerate(zip(completions, references,
                                                                    verdicts, strict=True))]
