"""The tables of docs/figures.md and the README's results, made from the figures' CSVs.

A table in a page follows a marker line `<!-- table: NAME -->`, NAME one of `TABLES`.
`render(NAME, figures)` makes it from the CSVs in the directory `figures` (docs/figures),
recomputing every mean, std, paired difference and 95% Student-t interval from the per-seed
values, never copying a CSV's own summary columns; `page_tables` reads the marked tables of
a page back. `tests/test_docs_numbers.py` fails while a page's marked table is not what its
CSVs give, and on a table of docs/figures.md with no marker. After a figure is made again:

  python -m sera_jax.harness.figures.tables docs/figures.md README.md   # rewrites the tables

mean ± std is over the reported seeds (std with ddof 0, as the figures print it); a paired
difference is mean ± the half-width of its 95% Student-t interval, with the seeds ahead /
behind (by more than 0.005).
"""

import re
import sys
from collections.abc import Callable, Sequence

import numpy as np

from sera_jax.common import files
from sera_jax.harness.figures.common import DIFFERENCE, mean_interval

MARKER = re.compile(r"^<!-- table: (\S+) -->$")
LEVEL = 0.005  # a paired difference within this is level, neither ahead nor behind
MINUS = "−"  # the pages' minus sign


def _rows(figures, name: str) -> list[dict]:
  return files.read_csv(files.path(figures) / name)


def _seed_values(row: dict) -> np.ndarray:
  return np.array([float(v) for k, v in row.items() if re.fullmatch(r"seed\d+", k)])


def _number(value: float, digits: int = 3, sign: bool = False) -> str:
  text = f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"
  return text.replace("-", MINUS)


def spread(values: Sequence[float], digits: int = 3) -> str:
  """mean ± std (ddof 0) of per-seed values."""
  values = np.asarray(values, np.float64)
  return f"{_number(values.mean(), digits)} ± {values.std():.{digits}f}"


def paired(differences: Sequence[float], digits: int = 3) -> str:
  """mean ± 95% half-width of per-seed paired differences, and the seeds ahead / behind."""
  differences = np.asarray(differences, np.float64)
  mean, half = mean_interval(differences)
  ahead, behind = int(np.sum(differences > LEVEL)), int(np.sum(differences < -LEVEL))
  return f"{_number(mean, digits, sign=True)} ± {half:.{digits}f} ({ahead} / {behind})"


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _difference_name(name: str) -> str:
  return name.replace(DIFFERENCE, f" {MINUS} ")


# ---------------------------------------------------------------------------- the tables


def alignment_runs(figures) -> str:
  """Mean cosines over the steps of each trajectory of `sera-jax plot`'s two runs."""
  series = ("cos/sera_expected", "cos/sera_realized", "cos/uniform_expected",
            "cos/uniform_realized")
  rows = _rows(figures, "alignment_runs.csv")
  table = []
  for run in dict.fromkeys(row["run"] for row in rows):
    means = [np.mean([float(r["value"]) for r in rows if r["run"] == run and r["series"] == s])
             for s in series]
    table.append([f"`method={run}` run", *(_number(m) for m in means)])
  return markdown(["trajectory", "SERA expected", "SERA realized", "uniform expected",
                   "uniform realized"], table)


BUDGET_METHODS = ("uniform", "equalized", "sera", "knapsack", "gvm", "adaptive")


def alignment_vs_budget(figures) -> str:
  """Realized (expected) cosine of each method at each N0, mean over the snapshots."""
  rows = _rows(figures, "alignment_vs_budget.csv")
  table = []
  for n0 in sorted({int(r["N0"]) for r in rows}):
    cells = []
    for method in BUDGET_METHODS:
      points = [r for r in rows if int(r["N0"]) == n0 and r["method"] == method]
      cells.append(f"{np.mean([float(r['realized_cos_mean']) for r in points]):.3f} "
                   f"({np.mean([float(r['expected_cos']) for r in points]):.3f})")
    table.append([str(n0), *cells])
  return markdown(["N0", *BUDGET_METHODS], table)


def scale_equalization(figures) -> str:
  """kappa of the batch's prompts under uniform and SERA counts, at each snapshot."""
  rows = _rows(figures, "scale_equalization.csv")
  table = []
  for snapshot in dict.fromkeys(r["snapshot"] for r in rows):
    points = [r for r in rows if r["snapshot"] == snapshot]
    uniform = [float(r["uniform_kappa"]) for r in points]
    active = [float(r["sera_kappa"]) for r in points if r["sera_active"] == "True"]
    table.append([f"{snapshot} (step {points[0]['step']})",
                  f"{min(uniform):.3f} – {max(uniform):.3f}",
                  f"{min(active):.3f} – {max(active):.3f}",
                  f"{float(points[0]['sera_waterline']):.3f}",
                  f"{len(active)} / {len(points)}"])
  return markdown(["snapshot", "uniform kappa", "SERA kappa (active)", "SERA waterline",
                   "SERA active prompts"], table)


def ablations(figures) -> str:
  """Each variant's change from full SERA over every snapshot, batch and seed."""
  rows = [r for r in _rows(figures, "ablations.csv") if r["scope"] == "all"]
  return markdown(["variant", "expected cosine", "change in expected", "change in realized"], [
      [r["variant"], _number(float(r["expected_cos"]), 4),
       _number(float(r["delta_expected"]), 4, sign=True),
       f"{_number(float(r['delta_realized']), 4, sign=True)} ± "
       f"{float(r['delta_realized_ci95']):.4f}"] for r in rows])


OUTCOME_KS = (1, 256, 1024)


def training_outcome(figures) -> str:
  """Held-out pass@k at each method's chosen rate, and SERA − uniform paired by seed."""
  rows = _rows(figures, "training_outcome.csv")
  value = {(r["dataset"], r["method"], int(r["k"])): _seed_values(r) for r in rows}
  rate = {(r["dataset"], r["method"]): r["learning_rate"] for r in rows}
  table = []
  for dataset, method in rate:
    table.append([dataset, method, rate[dataset, method],
                  *(spread(value[dataset, method, k]) for k in OUTCOME_KS)])
    if method == "uniform" and (dataset, "sera") in rate:
      table.append([dataset, f"sera {MINUS} uniform", "",
                    *(paired(value[dataset, "sera", k] - value[dataset, "uniform", k])
                      for k in OUTCOME_KS)])
  return markdown(["dataset", "method", "rate", *(f"pass@{k}" for k in OUTCOME_KS)], table)


SCALING_KS = (1, 256)


class _Finals:
  """The budget-scaling CSV's last evaluation of each (N0, method, seed)."""

  def __init__(self, figures):
    self.last = {}
    for r in _rows(figures, "budget_scaling.csv"):
      key = (int(r["N0"]), r["method"], int(r["seed"]))
      if key not in self.last or int(r["step"]) > int(self.last[key]["step"]):
        self.last[key] = r
    self.seeds = sorted({seed for _, _, seed in self.last})
    self.rates = {}
    for (n0, method, _), r in self.last.items():
      self.rates.setdefault((n0, method), r["learning_rate"])
    self.n0s = sorted({n0 for n0, _ in self.rates})

  def values(self, n0: int, method: str, k: int) -> np.ndarray:
    return np.array([float(self.last[n0, method, s][f"pass@{k}"]) for s in self.seeds])

  def difference(self, n0: int, k: int) -> str:
    return paired(self.values(n0, "sera", k) - self.values(n0, "uniform", k))


def budget_scaling(figures) -> str:
  """Final held-out pass@k of each (N0, method) at its chosen rate, and SERA − uniform."""
  finals = _Finals(figures)
  table = []
  first = finals.n0s[0]
  if (first, "ce") in finals.rates:  # one ce run per seed, drawn at every N0
    table.append(["any", "ce", finals.rates[first, "ce"],
                  *(spread(finals.values(first, "ce", k)) for k in SCALING_KS)])
  for n0 in finals.n0s:
    methods = [m for (n, m) in finals.rates if n == n0 and m != "ce"]
    for method in methods:
      table.append([str(n0), method, finals.rates[n0, method],
                    *(spread(finals.values(n0, method, k)) for k in SCALING_KS)])
    if {"sera", "uniform"} <= set(methods):
      table.append([str(n0), f"sera {MINUS} uniform", "",
                    *(finals.difference(n0, k) for k in SCALING_KS)])
  return markdown(["N0", "method", "rate", *(f"pass@{k}" for k in SCALING_KS)], table)


def pass_at_k(path: str, ks: Sequence[int]) -> Callable[[str], str]:
  """The table of a pass@k CSV (`common.write_pass_at_k_csv`): each method's mean ± std, then
  each paired difference, at `ks` (those the CSV holds)."""
  def table(figures) -> str:
    rows = _rows(figures, path)
    held = [k for k in ks if any(int(r["k"]) == k for r in rows)]
    value = {(r["method"], int(r["k"])): _seed_values(r) for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    body = []
    for method in methods:
      if DIFFERENCE in method:  # recomputed from the two methods' seeds, not read back
        first, _, second = method.partition(DIFFERENCE)
        body.append([_difference_name(method), *(
            paired(value[first, k] - value[second, k]) for k in held)])
      else:
        body.append([method, *(spread(value[method, k]) for k in held)])
    return markdown(["", *(f"pass@{k}" for k in held)], body)
  return table


def validation_rates(path: str, k: int) -> Callable[[str], str]:
  """The table of a rate grid's CSV (`common.write_validation_grid_csv`): each method's
  validation pass@k at each rate, mean over the tuning seeds (bold: chosen)."""
  def table(figures) -> str:
    rows = _rows(figures, path)
    rates = sorted({float(r["learning_rate"]) for r in rows})
    body = []
    for method in dict.fromkeys(r["method"] for r in rows):
      cells = []
      for rate in rates:
        runs = [r for r in rows if r["method"] == method and float(r["learning_rate"]) == rate]
        score = f"{np.mean([float(r[f'validation_pass@{k}']) for r in runs]):.3f}" if runs else ""
        cells.append(f"**{score}**" if runs and runs[0]["chosen"] == "True" else score)
      body.append([method, *cells])
    return markdown(["method", *(f"{rate:g}" for rate in rates)], body)
  return table


def sim_budget(figures) -> str:
  """Each method's share of episodes on hard scenarios (mean over each run's steps), over
  the seeds, and its paired difference to uniform."""
  rows = _rows(figures, "sim/sim_budget.csv")
  share = {}
  for r in rows:
    share.setdefault(r["method"], {})[int(r["seed"])] = float(r["hard_fraction"])
  body = [[method, spread(list(by_seed.values()))] for method, by_seed in share.items()]
  for method, by_seed in share.items():
    if method != "uniform" and "uniform" in share:
      body.append([f"{method} {MINUS} uniform", paired(
          [by_seed[seed] - share["uniform"][seed] for seed in by_seed])])
  return markdown(["", "share of episodes on hard scenarios"], body)


def _sera_minus_uniform(figures, path: str, ks: tuple[int, ...]) -> str:
  """"pass@k DIFFERENCE, ..." of a pass@k CSV: SERA against uniform MaxRL at each k."""
  rows = {(r["method"], int(r["k"])): _seed_values(r) for r in _rows(figures, path)}
  return ", ".join(f"pass@{k} " + paired(rows["sera", k] - rows["uniform", k]) for k in ks)


def results(figures) -> str:
  """The README's results: each claim of the paper, this project's number and the figure
  that shows it."""
  outcome = {(r["dataset"], r["method"], int(r["k"])): _seed_values(r)
             for r in _rows(figures, "training_outcome.csv")}
  finals = _Finals(figures)
  budget = _rows(figures, "alignment_vs_budget.csv")
  at_8 = [r for r in budget if int(r["N0"]) == 8]
  realized = {method: np.mean([float(r["realized_cos_mean"]) for r in at_8
                               if r["method"] == method]) for method in ("sera", "uniform")}
  snapshots, seeds = len({r["snapshot"] for r in at_8}), at_8[0]["num_seeds"]
  page = "docs/figures.md"
  rows = [
      ["at a fixed budget SERA's gradient is closer to the exact one",
       f"realized cosine at N0 = 8: SERA {realized['sera']:.3f}, uniform "
       f"{realized['uniform']:.3f} (mean of {snapshots} snapshots x {seeds} seeds)",
       f"[alignment vs budget]({page}#alignment-versus-budget)"],
      ["SERA trains better from a cold start (the ImageNet stand-in, 1000 classes)",
       "pass@1 " + paired(outcome["synthetic1000", "sera", 1]
                          - outcome["synthetic1000", "uniform", 1]),
       f"[training outcome]({page}#training-outcome)"],
      *([f"... and at every budget: N0 = {n0}", f"pass@1 {finals.difference(n0, 1)}",
         f"[budget scaling]({page}#budget-scaling-from-the-cold-start)"]
        for n0 in finals.n0s),
      ["SERA keeps coverage in math reasoning",
       _sera_minus_uniform(figures, "math_passk.csv", (256,)),
       f"[math]({page}#math-reasoning-through-the-tunix-learner)"],
      ["SERA trains a better policy in navigation (held-out mazes)",
       _sera_minus_uniform(figures, "maze/maze_passk.csv", (1, 512)),
       f"[maze navigation]({page}#maze-navigation)"],
      ["spreading simulation episodes over scenarios trains a better policy (MuJoCo MJX)",
       "held-out " + _sera_minus_uniform(figures, "sim/sim_passk.csv", (1, 64)),
       f"[simulated scenarios]({page}#simulated-scenarios-in-mujoco-mjx)"],
  ]
  return markdown(["the paper's claim", f"this project: SERA {MINUS} uniform MaxRL, mean ± 95% "
                   "interval over seeds (seeds ahead / behind)", "figure"], rows)


TABLES: dict[str, Callable[[str], str]] = {
    "alignment_runs": alignment_runs,
    "alignment_vs_budget": alignment_vs_budget,
    "scale_equalization": scale_equalization,
    "ablations": ablations,
    "training_outcome": training_outcome,
    "budget_scaling": budget_scaling,
    "maze_passk": pass_at_k("maze/maze_passk.csv", (1, 4, 16, 64, 256, 512)),
    "maze_passk_unseen_path": pass_at_k("maze/maze_passk_unseen_path.csv", (1, 16, 256, 512)),
    "maze_rates": validation_rates("maze/maze_passk_rates.csv", 16),
    "math_passk": pass_at_k("math_passk.csv", (1, 16, 256)),
    "sim_passk": pass_at_k("sim/sim_passk.csv", (1, 4, 16, 64)),
    "sim_rates": validation_rates("sim/sim_passk_rates.csv", 8),
    "sim_budget": sim_budget,
    "results": results,
}


def render(name: str, figures: str = "docs/figures") -> str:
  """The markdown table `name` made from the CSVs in `figures`."""
  if name not in TABLES:
    raise ValueError(f"no table {name!r}; the tables are {', '.join(TABLES)}.")
  return TABLES[name](figures)


def page_tables(text: str) -> list[tuple[str | None, str]]:
  """Every table of a markdown page: (the NAME of the marker line above it, or None when it
  has none, its text)."""
  lines, found, i = text.splitlines(), [], 0
  while i < len(lines):
    if lines[i].startswith("|"):
      end = i
      while end < len(lines) and lines[end].startswith("|"):
        end += 1
      marker = MARKER.match(lines[i - 1]) if i else None
      found.append((marker.group(1) if marker else None, "\n".join(lines[i:end])))
      i = end
    else:
      i += 1
  return found


def problems(text: str, figures: str = "docs/figures", *, every_table_marked: bool = True
             ) -> list[str]:
  """What is wrong with the tables of a page `text`: a marked table that is not what its
  CSVs give (the first differing line), and, with `every_table_marked`, a table with no
  marker (typed in)."""
  found = []
  for name, table in page_tables(text):
    if name is None:
      if every_table_marked:
        found.append(f"a table with no marker (typed in): {table.splitlines()[0]}")
      continue
    expected = render(name, figures)
    for line, want in zip(table.splitlines(), expected.splitlines(), strict=False):
      if line != want:
        found.append(f"table {name}: the page has\n  {line}\nits CSVs give\n  {want}")
        break
    else:
      if len(table.splitlines()) != len(expected.splitlines()):
        found.append(f"table {name}: {len(table.splitlines())} lines, its CSVs give "
                     f"{len(expected.splitlines())}")
  return found


def rewrite(path: str, figures: str = "docs/figures") -> list[str]:
  """Rewrites each marked table of the page `path` from the CSVs; returns the names."""
  text = files.path(path).read_text()
  names = []
  for name, table in page_tables(text):
    if name is not None:
      text = text.replace(f"<!-- table: {name} -->\n{table}",
                          f"<!-- table: {name} -->\n{render(name, figures)}")
      names.append(name)
  files.write_text(path, text)
  return names


def main(argv: list[str] | None = None) -> None:
  pages = sys.argv[1:] if argv is None else argv
  if not pages:
    raise SystemExit("usage: python -m sera_jax.harness.figures.tables PAGE.md [PAGE.md ...]")
  for page in pages:
    print(f"{page}: {', '.join(rewrite(page)) or 'no marked table'}")


if __name__ == "__main__":
  main()
