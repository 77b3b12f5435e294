"""The check every figure test makes of the manifest its figure wrote."""

import json
import pathlib
import subprocess

import jax


def assert_manifest(out: pathlib.Path, name: str, command: str, argv: list[str],
                    seeds: list[int], tuning_seeds: list[int]) -> dict:
  """`out`/`name`.manifest.json records this command (`sera-jax COMMAND ARGV`), the commit
  checked out, this process's versions and device, these seeds and a wall time; returns it."""
  manifest = json.loads((out / f"{name}.manifest.json").read_text())
  assert manifest["command"] == " ".join(["sera-jax", command, *argv])
  assert (manifest["seeds"], manifest["tuning_seeds"]) == (seeds, tuning_seeds)
  assert manifest["jax_version"] == jax.__version__ and manifest["device"].startswith("cpu")
  assert manifest["wall_time_s"] > 0 and manifest["made_at"].endswith("Z")
  assert isinstance(manifest["uncommitted_changes"], bool) and manifest["protocol"]
  head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                        check=True, cwd=pathlib.Path(__file__).parent).stdout.strip()
  assert manifest["git_commit"] == head
  return manifest
