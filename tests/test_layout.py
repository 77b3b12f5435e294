"""The package's layers: imports run only downward, never in a circle.

See docs/method.md#the-packages-layers.

harness -> settings -> common -> method, read from every module's source
(imports inside functions count too). A setting imports no other setting;
the method imports nothing but itself, the standard library, jax, numpy and
chex; nothing inside the package imports its public face `sera_jax`.
"""

import ast
import importlib
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "sera_jax"
LAYERS = ("method", "common", "settings", "harness")  # lowest first
METHOD_THIRD_PARTY = {"jax", "numpy", "chex"}


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(*roots: str) -> dict[str, pathlib.Path]:
  """{module name: file} of every Python file under the given top-level folders."""
  return {module_name(path): path for root in roots
          for path in sorted((REPO / root).rglob("*.py"))}


def imported_names(path: pathlib.Path, known: set[str]) -> set[str]:
  """Every module that `path` imports, anywhere in it; `known` resolves `from A import B`."""
  name = module_name(path)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative import
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
      for alias in node.names:
        candidate = f"{base}.{alias.name}"
        names.add(candidate if candidate in known else base)
  return names


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
  """Edges between the given modules only."""
  known = set(modules)
  return {name: imported_names(path, known) & known for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
  """One import cycle of `graph` as [a, b, ..., a], or [] when there is none."""
  state = dict.fromkeys(graph, 0)  # 0 unvisited, 1 on the stack, 2 done
  stack: list[str] = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for target in sorted(graph.get(node, ())):
      if state.get(target) == 1:
        return [*stack[stack.index(target):], target]
      if state.get(target) == 0 and (cycle := visit(target)):
        return cycle
    stack.pop()
    state[node] = 2
    return []

  for node in sorted(graph):
    if state[node] == 0 and (cycle := visit(node)):
      return cycle
  return []


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
  """Edges that run upward, across settings, or into the package's face."""
  def place(module):  # (layer rank, setting name or None)
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
      return None
    setting = parts[2] if parts[1] == "settings" and len(parts) > 2 else None
    return LAYERS.index(parts[1]), setting

  bad = []
  for source, targets in graph.items():
    for target in sorted(targets):
      if target == "sera_jax" and source != "sera_jax":
        bad.append(f"{source} imports the package face sera_jax")
        continue
      if source == "sera_jax" or place(source) is None or place(target) is None:
        continue
      (source_rank, source_setting), (target_rank, target_setting) = place(source), place(target)
      if target_rank > source_rank:
        bad.append(f"{source} ({LAYERS[source_rank]}) imports {target} ({LAYERS[target_rank]})")
      elif source_setting and target_setting and source_setting != target_setting:
        bad.append(f"setting {source} imports another setting, {target}")
  return bad


# ----------------------------------------------------------------------------- the checkers


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
  assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_layer_violations_catch_upward_and_sideways_imports():
  graph = {"sera_jax.method.allocation": {"sera_jax.harness.train"},
           "sera_jax.settings.maze.task": {"sera_jax.settings.classification.task",
                                           "sera_jax.common.optim"},
           "sera_jax.common.optim": {"sera_jax"},
           "sera_jax.harness.cli": {"sera_jax.method.allocation"}}
  assert layer_violations(graph) == [
      "sera_jax.method.allocation (method) imports sera_jax.harness.train (harness)",
      "setting sera_jax.settings.maze.task imports another setting, "
      "sera_jax.settings.classification.task",
      "sera_jax.common.optim imports the package face sera_jax"]


def test_imported_names_resolve_modules_and_names_in_modules():
  source = PACKAGE / "harness" / "sweep.py"
  known = set(modules_of("sera_jax"))
  names = imported_names(source, known)
  assert {"sera_jax.harness.configs", "sera_jax.harness.train"} <= names


# ----------------------------------------------------------------------------- the package


def test_every_module_is_in_a_layer():
  stray = [name for name in modules_of("sera_jax")
           if name != "sera_jax" and name.split(".")[1] not in LAYERS]
  assert not stray, f"modules outside method/common/settings/harness: {stray}"


def test_no_import_cycle():
  graph = import_graph(modules_of("sera_jax", "verification", "experiments"))
  assert find_cycle(graph) == []


def test_imports_run_only_downward():
  assert layer_violations(import_graph(modules_of("sera_jax"))) == []


def test_the_method_imports_only_jax_numpy_chex_and_the_standard_library():
  known = set(modules_of("sera_jax"))
  for name, path in modules_of("sera_jax/method").items():
    for imported in imported_names(path, known):
      top = imported.split(".")[0]
      if top == "sera_jax":
        assert imported.startswith("sera_jax.method"), f"{name} imports {imported}"
      else:
        assert top in METHOD_THIRD_PARTY or top in sys.stdlib_module_names, (
            f"{name} imports {imported}")


def test_verification_and_experiments_sit_above_the_right_layers():
  graph = import_graph(modules_of("sera_jax", "verification", "experiments"))
  for name, targets in graph.items():
    if name.startswith("verification"):
      assert all(t.startswith(("verification", "sera_jax.method")) for t in targets), name
    if name.startswith("experiments"):
      assert all(t.startswith("sera_jax.harness") for t in targets), name


@pytest.mark.parametrize("name", sorted(modules_of("sera_jax")))
def test_every_module_imports(name):
  importlib.import_module(name)
