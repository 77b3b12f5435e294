"""The numbers of docs/figures.md and the README are the ones their figures' CSVs give."""

import pathlib

import numpy as np
import pytest

from sera_jax.common import files
from sera_jax.harness.figures import tables

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
PAGES = {"docs/figures.md": True, "README.md": False}  # page: every table must be marked


@pytest.mark.parametrize("page", PAGES)
def test_every_marked_table_is_what_its_csvs_give(page):
  text = (ROOT / page).read_text()
  assert tables.problems(text, FIGURES, every_table_marked=PAGES[page]) == []


def test_the_readme_has_the_results_table_and_the_figures_page_every_figure_table():
  marked = lambda page: {name for name, _ in tables.page_tables((ROOT / page).read_text())}  # noqa: E731
  assert marked("README.md") == {"results"}
  assert {"alignment_runs", "alignment_vs_budget", "scale_equalization", "ablations",
          "training_outcome", "budget_scaling", "maze_passk", "maze_passk_unseen_path",
          "maze_rates", "math_passk", "sim_passk", "sim_rates",
          "sim_budget"} <= marked("docs/figures.md")


def test_an_altered_cell_or_a_typed_table_is_reported():
  text = (ROOT / "docs" / "figures.md").read_text()
  table = tables.render("training_outcome", FIGURES)
  cell = table.splitlines()[3].split(" | ")[3]  # a mean ± std of the second method
  mean = cell.split(" ± ")[0]
  altered_cell = cell.replace(mean, f"{float(mean) + 0.001:.3f}")
  altered = text.replace(table, table.replace(cell, altered_cell, 1))
  assert altered != text
  [problem] = tables.problems(altered, FIGURES)
  assert problem.startswith("table training_outcome: the page has") and mean in problem
  typed = text + "\n| a | typed |\n|---|---|\n| table | here |\n"
  assert tables.problems(typed, FIGURES) == ["a table with no marker (typed in): | a | typed |"]
  assert tables.problems(typed, FIGURES, every_table_marked=False) == []


def test_rewrite_puts_back_what_the_csvs_give(tmp_path):
  page = tmp_path / "page.md"
  text = (ROOT / "docs" / "figures.md").read_text()
  table = tables.render("math_passk", FIGURES)
  page.write_text(text.replace(table, table.replace("0.", "9.")))
  assert tables.problems(page.read_text(), FIGURES)
  assert "math_passk" in tables.rewrite(page, FIGURES)
  assert page.read_text() == text


@pytest.mark.parametrize("name", ["training_outcome.csv", "math_passk.csv"])
def test_the_csvs_summary_columns_agree_with_their_seeds(name):
  """A CSV's own mean and std (what a reader of the CSV sees) are those of its seed columns,
  the values the tables are made from."""
  for row in files.read_csv(FIGURES / name):
    seeds = np.array([float(v) for k, v in row.items() if k.startswith("seed")])
    np.testing.assert_allclose(float(row["mean"]), seeds.mean(), atol=6e-5)
    np.testing.assert_allclose(float(row["std"]), seeds.std(), atol=6e-5)


def test_the_paired_cell_is_the_mean_and_t_interval_of_the_differences():
  differences = [0.01, 0.03, -0.002, 0.02]
  mean, std = np.mean(differences), np.std(differences, ddof=1)
  half = 3.182446305284263 * std / 2  # t(0.975, 3) * std / sqrt(4)
  assert tables.paired(differences) == f"+{mean:.3f} ± {half:.3f} (3 / 0)"
  assert tables.spread([0.2, 0.4]) == "0.300 ± 0.100"
  assert tables.paired([-0.01, -0.02]).startswith("−0.015")


def test_the_maze_rates_table_bolds_each_methods_chosen_rate(tmp_path):
  rows = [{"method": m, "learning_rate": rate, "seed": seed, "chosen": rate == chosen,
           "validation_pass@16": f"{score + (seed - 100) / 100:.4f}"}
          for m, chosen in (("sera", 1e-4), ("uniform", 3e-4))
          for rate, score in ((1e-4, 0.5), (3e-4, 0.6)) for seed in (100, 101)]
  (tmp_path / "maze").mkdir()
  files.write_csv(tmp_path / "maze" / "maze_passk_rates.csv", rows)
  assert tables.render("maze_rates", tmp_path).splitlines()[2:] == [
      "| sera | **0.505** | 0.605 |", "| uniform | 0.505 | **0.605** |"]


def test_an_unknown_table_is_named_with_the_known_ones():
  with pytest.raises(ValueError, match="no table 'nope'; the tables are alignment_runs"):
    tables.render("nope", FIGURES)
