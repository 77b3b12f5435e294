"""The repository is clean under `ruff check` with the project's configuration (pyproject.toml).

A lint error fails the suite with ruff's own report of it.
"""

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "pyproject.toml"


def ruff_check(path: pathlib.Path) -> subprocess.CompletedProcess:
  """`ruff check` of `path` with the project's configuration, run from the repository root."""
  return subprocess.run(
      [sys.executable, "-m", "ruff", "check", "--config", str(CONFIG), "--no-cache",
       "--output-format", "concise", str(path)],
      cwd=REPO, capture_output=True, text=True, check=False)


def test_ruff_finds_nothing_in_the_repository():
  result = ruff_check(REPO)
  if result.returncode != 0:
    pytest.fail(f"ruff check found lint errors:\n{result.stdout}{result.stderr}", pytrace=False)


def test_ruff_check_reports_an_error_under_the_projects_line_length(tmp_path):
  # Line 1 has 100 characters, over ruff's default of 88 but within the project's 100;
  # line 2 has 101. Only line 2 is reported when the project's configuration is read.
  source = tmp_path / "long.py"
  source.write_text(f"x = {'1' * 96}\ny = {'2' * 97}\n")
  result = ruff_check(source)
  assert result.returncode == 1
  assert ":2:101: E501" in result.stdout
  assert ":1:" not in result.stdout
