"""The README's Python examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_examples():
  assert BLOCKS


@pytest.mark.parametrize("index", [
    # A block that trains a model through Tunix is an end-to-end run: the slow tier.
    pytest.param(i, marks=[pytest.mark.slow] if "settings.llm" in block else [])
    for i, block in enumerate(BLOCKS)])
def test_readme_python_example_runs(index, capsys):
  exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})  # noqa: S102
  assert capsys.readouterr().out  # every example prints what it shows
