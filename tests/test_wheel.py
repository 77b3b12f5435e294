"""The built wheel runs without the checkout: configs and figures ship inside the package.

The wheel is installed (not editable) into a fresh virtual environment that
borrows this environment's dependencies through a .pth file and nothing else,
and every command runs from an unrelated directory, so nothing can be found
next to the source tree.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import pytest

from sera_jax.harness import train

REPO = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(command, cwd, env=None):
  result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
  return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(bin directory, environment, working directory) of a venv holding only the wheel."""
  root = tmp_path_factory.mktemp("wheel")
  # Built from a copy of the sources: a build in the checkout would write its build/ and
  # egg-info there while other tests read the tree. No build isolation: the build needs no
  # index, only this environment's setuptools.
  sources = root / "sources"
  shutil.copytree(REPO, sources, ignore=shutil.ignore_patterns(
      ".git", ".venv", ".pytest_cache", ".ruff_cache", ".hypothesis", "__pycache__", "build",
      "runs", "workdir*", "*.egg-info"))
  _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "-w", str(root / "dist"), str(sources)], cwd=root)
  (wheel,) = (root / "dist").glob("sera_jax-*.whl")
  venv = root / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
  bin_dir = venv / "bin"
  site = pathlib.Path(_run([str(bin_dir / "python"), "-c",
                            "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           cwd=root).strip())
  # This environment's site-packages as a plain path: its dependencies, but not its
  # editable finder for the checkout (.pth files are not processed in a .pth path).
  (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  _run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install",
        "--no-deps", "--no-index", str(wheel)], cwd=root)
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
  elsewhere = root / "elsewhere"
  elsewhere.mkdir()
  return bin_dir, env, elsewhere


def test_the_installed_package_is_the_wheel(installed):
  bin_dir, env, cwd = installed
  location = _run([str(bin_dir / "python"), "-c", "import sera_jax; print(sera_jax.__file__)"],
                  cwd, env)
  assert pathlib.Path(location.strip()).is_relative_to(bin_dir.parent)


def test_the_wheel_carries_its_version_and_license(installed):
  bin_dir, env, cwd = installed
  out = _run([str(bin_dir / "python"), "-c",
              "import sera_jax; from importlib import metadata; "
              "d = metadata.distribution('sera_jax'); print(sera_jax.__version__); "
              "print(d.metadata['License-Expression']); print(d.read_text('licenses/LICENSE'))"],
             cwd, env)
  version, expression, license_text = out.split("\n", 2)
  assert version == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
  assert expression == "Apache-2.0"
  assert license_text.strip() == (REPO / "LICENSE").read_text().strip()


def test_the_wheel_installs_one_top_level_package(installed):
  """Everything ships under sera_jax (a top-level `verification` would collide with others')."""
  bin_dir, env, cwd = installed
  out = _run([str(bin_dir / "python"), "-c",
              "from importlib import metadata; import sera_jax.verification.reference; "
              "print(*metadata.files('sera_jax'), sep='\\n')"], cwd, env)
  shipped = [pathlib.PurePosixPath(line) for line in out.splitlines()]
  packaged = {path.parts[0] for path in shipped
              if path.parts[0] != ".." and not path.parts[0].endswith(".dist-info")}
  assert packaged == {"sera_jax"}
  assert pathlib.PurePosixPath("sera_jax/verification/reference.py") in shipped


def test_train_runs_the_default_config(installed):
  bin_dir, env, cwd = installed
  out = _run([str(bin_dir / "sera-jax"), "train", "--config.num_steps=3"], cwd, env)
  assert "outputs in runs/default-sera" in out
  assert [row["step"] for row in train.read_metrics(cwd / "runs" / "default-sera")] == [0, 1, 2]


def test_train_takes_a_shipped_config_by_name(installed):
  bin_dir, env, cwd = installed
  out = _run([str(bin_dir / "sera-jax"), "train", "--config", "synthetic1000",
              "--config.num_steps=2"], cwd, env)
  assert "outputs in runs/synthetic1000-sera" in out


def test_figure_help_comes_from_the_package(installed):
  bin_dir, env, cwd = installed
  out = _run([str(bin_dir / "sera-jax"), "figure", "budget", "--help"], cwd, env)
  assert "usage: sera-jax figure budget" in out and "--out" in out
