"""The benchmark scripts run as documented (smoke tests: no timing is asserted)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))

import alignment_step  # noqa: E402
import run as benchmark_table  # noqa: E402


@pytest.mark.slow
def test_step_ratios_measure_every_step():
  best = alignment_step.measure("mlp", batch=8, rounds=1, repeats=1)
  assert set(best) == {"ce", "alignment", "sera", "gradients"}
  assert all(0 < seconds < 60 for seconds in best.values())


def test_allocator_rows_match_the_reference():
  rows = benchmark_table.allocator_rows(256, repeats=1)
  x64 = next(row for row in rows if row[0].endswith("x64"))
  assert x64[3] is True and "counts identical" in x64[4]


@pytest.mark.slow
def test_peak_memory_row_is_under_the_target():
  name, value, target, ok, note = benchmark_table.peak_memory_row()
  assert ok, (value, note)
