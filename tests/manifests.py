"""The check every figure test makes of the manifest its figure wrote."""

import json
import pathlib

import jax


def assert_manifest(out: pathlib.Path, name: str, figure: str, argv: list[str],
                    seeds: list[int], tuning_seeds: list[int]) -> dict:
  """`out`/`name`.manifest.json records this command, this process's versions and device,
  these seeds and a wall time; returns it."""
  manifest = json.loads((out / f"{name}.manifest.json").read_text())
  assert manifest["command"] == " ".join(["sera-jax figure", figure, *argv])
  assert (manifest["seeds"], manifest["tuning_seeds"]) == (seeds, tuning_seeds)
  assert manifest["jax_version"] == jax.__version__ and manifest["device"].startswith("cpu")
  assert manifest["wall_time_s"] > 0 and manifest["made_at"].endswith("Z")
  assert isinstance(manifest["uncommitted_changes"], bool) and manifest["protocol"]
  return manifest
