"""The experiment configs shipped in the package, addressable by name or by path.

Each `NAME.py` beside this module has a `get_config()` returning a locked
`ml_collections.ConfigDict`; `--config NAME` (e.g. `--config synthetic1000`)
and `--config path/to/file.py` both work wherever a config is taken. A value
that names an existing file is a path; otherwise it must be one of `names()`.
"""

import importlib.machinery
import importlib.util
import pathlib

import ml_collections
from absl import flags
from ml_collections import config_flags

CONFIG_DIR = pathlib.Path(__file__).resolve().parent
DEFAULT = "default"
_NOT_CONFIGS = ("__init__", "base")


def names() -> tuple[str, ...]:
  """The names of the shipped configs."""
  return tuple(sorted(path.stem for path in CONFIG_DIR.glob("*.py")
                      if path.stem not in _NOT_CONFIGS))


def help_text() -> str:
  """The help of every --config option."""
  return f"experiment config: a file, or a shipped name ({', '.join(names())})"


def config_file(name_or_path: str | pathlib.Path) -> pathlib.Path:
  """The file of a config given by name ('synthetic1000') or by path.

  Raises:
    FileNotFoundError: neither an existing file nor a shipped config name.
  """
  path = pathlib.Path(name_or_path)
  if path.is_file():
    return path
  if str(name_or_path) in names():
    return CONFIG_DIR / f"{name_or_path}.py"
  raise FileNotFoundError(f"no config {str(name_or_path)!r}: give a config file or one of the "
                          f"shipped configs {', '.join(names())}.")


def load(name_or_path: str | pathlib.Path) -> ml_collections.ConfigDict:
  """`get_config()` of the config given by name or by path (a file of any suffix)."""
  path = config_file(name_or_path)
  loader = importlib.machinery.SourceFileLoader(path.stem, str(path))
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
  loader.exec_module(module)
  return module.get_config()


def resolve_config_argument(argv: list[str]) -> list[str]:
  """`argv` with the value of --config (a name or a path) replaced by its file."""
  resolved = list(argv)
  for index, arg in enumerate(resolved):
    if arg.startswith("--config="):
      resolved[index] = f"--config={config_file(arg.removeprefix('--config='))}"
    elif arg == "--config" and index + 1 < len(resolved):
      resolved[index + 1] = str(config_file(resolved[index + 1]))
  return resolved


def train_flags(argv: list[str]) -> flags.FlagValues:
  """The parsed flags of `sera-jax train` (argv[0] is the program name).

  Raises:
    FileNotFoundError: --config names no file and no shipped config.
    ValueError: an override of a key the config lacks.
    flags.Error, AttributeError, KeyError, ValueError: another bad flag or config override.
  """
  argv = resolve_config_argument(argv)
  try:
    return _parsed_train_flags(argv)
  except AttributeError:  # ml_collections' locked config: a KeyError('key') inside
    unknown = _unknown_override(argv)
    if unknown is None:
      raise
    raise ValueError(f"--config.{unknown}: the config has no key {unknown!r}.") from None


def _parsed_train_flags(argv: list[str]) -> flags.FlagValues:
  values = flags.FlagValues()
  # config_flags reads the --config.KEY overrides from sys_argv when defining them.
  config_flags.DEFINE_config_file(
      "config", str(config_file(DEFAULT)), help_text(),
      flag_values=values, lock_config=True, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "Output directory (default runs/<config>-<method>).",
                      flag_values=values)
  flags.DEFINE_bool("resume", False, "Require and resume from the workdir's latest checkpoint.",
                    flag_values=values)
  flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() first.",
                    flag_values=values)
  flags.DEFINE_string("coordinator", None, "host:port of process 0 (multihost, outside "
                      "TPU/SLURM auto-detection).", flag_values=values)
  flags.DEFINE_integer("num_processes", None, "Number of processes (multihost).",
                       flag_values=values)
  flags.DEFINE_integer("process_id", None, "This process's id (multihost).", flag_values=values)
  values(argv)
  return values


def _unknown_override(argv: list[str]) -> str | None:
  """The first --config.KEY override of `argv` (a resolved one) naming no key of its config."""
  files = [arg.removeprefix("--config=") for arg in argv if arg.startswith("--config=")]
  files += [value for arg, value in zip(argv, argv[1:], strict=False) if arg == "--config"]
  config = load(files[-1] if files else DEFAULT)
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    key = arg.removeprefix("--config.").partition("=")[0]
    node = config
    for part in key.split("."):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        return key
      node = node[part]
  return None
