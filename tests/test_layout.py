"""The package's layers: imports run only downward, never in a circle.

See docs/method.md#the-packages-layers.

harness -> settings -> common -> method, read from every module's source
(imports inside functions count too). A setting imports no other setting;
the method imports nothing but itself, the standard library, jax, numpy and
chex; nothing inside the package imports its public face `sera_jax`.

`sera_jax.verification` sits beside the layers, so that the oracle stays independent of the
code it checks: its reference imports only the standard library, numpy and scipy; its checks
import the method (what they compare with the reference) and no other layer; and no module
of the package outside it imports it. `sera_jax.testing`, helpers for users' test suites,
sits beside the layers too and imports only the method (and scipy, for Student's t).
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
VERIFICATION = "sera_jax.verification"
REFERENCE = f"{VERIFICATION}.reference"
REFERENCE_FILE = PACKAGE / "verification" / "reference.py"
REFERENCE_THIRD_PARTY = {"numpy", "scipy"}
TESTING = "sera_jax.testing"
TESTING_THIRD_PARTY = METHOD_THIRD_PARTY | {"scipy"}  # Student's t quantile


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


def in_verification(module: str) -> bool:
  return module == VERIFICATION or module.startswith(f"{VERIFICATION}.")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
  """Edges that run upward, across settings, into the package's face, into the verification
  from outside it, or from the verification into a layer other than the method."""
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
      if in_verification(target) and not in_verification(source):
        bad.append(f"{source} imports the verification, {target}")
        continue
      if in_verification(source) and place(target) and place(target)[0] > 0:
        bad.append(f"{source} (verification) imports {target} ({LAYERS[place(target)[0]]})")
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


def test_layer_violations_catch_imports_into_and_out_of_the_verification():
  graph = {"sera_jax.harness.cli": {"sera_jax.verification.checks"},
           "sera_jax": {"sera_jax.verification"},
           "sera_jax.verification.checks": {"sera_jax.method.allocation",
                                            "sera_jax.verification.reference",
                                            "sera_jax.common.optim"},
           "sera_jax.verification.__main__": {"sera_jax.verification.checks"}}
  assert layer_violations(graph) == [
      "sera_jax.harness.cli imports the verification, sera_jax.verification.checks",
      "sera_jax imports the verification, sera_jax.verification",
      "sera_jax.verification.checks (verification) imports sera_jax.common.optim (common)"]


def imports_beyond(modules: dict[str, pathlib.Path], third_party: set[str],
                   own: tuple[str, ...]) -> list[str]:
  """'A imports B' for each import B of `modules` that is neither a module under one of the
  prefixes `own`, nor the standard library or a `third_party` package outside sera_jax."""
  known = set(modules_of("sera_jax"))
  beyond = []
  for name, path in modules.items():
    for imported in sorted(imported_names(path, known)):
      top = imported.split(".")[0]
      if imported.startswith(own) or (
          top != "sera_jax" and (top in third_party or top in sys.stdlib_module_names)):
        continue
      beyond.append(f"{name} imports {imported}")
  return beyond


def test_imports_beyond_names_what_is_not_allowed():
  assert imports_beyond({REFERENCE: REFERENCE_FILE}, set(), ()) == [f"{REFERENCE} imports numpy"]
  checks = {f"{VERIFICATION}.checks": PACKAGE / "verification" / "checks.py"}
  assert f"{VERIFICATION}.checks imports sera_jax.method.scaling" in imports_beyond(
      checks, {"jax", "numpy"}, (VERIFICATION,))


def test_imported_names_resolve_modules_and_names_in_modules():
  source = PACKAGE / "harness" / "sweep.py"
  known = set(modules_of("sera_jax"))
  names = imported_names(source, known)
  assert {"sera_jax.harness.configs", "sera_jax.harness.train"} <= names


def private_uses(path: pathlib.Path, known: set[str], own: str | None = None) -> list[str]:
  """'A uses B._c' for each private name `_c` that module A (`path`, named `own`) takes from
  another sera_jax module B: `from B import _c`, or `B._c` on a name bound to B by an import."""
  own = own or module_name(path)
  tree = ast.parse(path.read_text(), filename=str(path))
  bound = {}  # local name -> the sera_jax module it is bound to
  uses = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      bound.update({(alias.asname or alias.name): alias.name for alias in node.names
                    if alias.name in known})
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sera_jax"):
      for alias in node.names:
        candidate = f"{node.module}.{alias.name}"
        if candidate in known:
          bound[alias.asname or alias.name] = candidate
        elif alias.name.startswith("_") and node.module != own:
          uses.append(f"{own} uses {node.module}.{alias.name}")
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in bound and bound[node.value.id] != own
        and node.attr.startswith("_") and not node.attr.startswith("__")):
      uses.append(f"{own} uses {bound[node.value.id]}.{node.attr}")
  return sorted(set(uses))


def test_private_uses_finds_private_names_taken_across_modules(tmp_path):
  module = PACKAGE / "harness" / "cli.py"
  known = set(modules_of("sera_jax"))
  assert private_uses(module, known) == []
  fake = tmp_path / "sera_jax" / "harness" / "fake.py"
  fake.parent.mkdir(parents=True)
  fake.write_text("from sera_jax.method import allocation\n"
                  "from sera_jax.method.validation import _hidden\n"
                  "allocation._check(allocation.allocate, allocation.__name__)\n")
  assert private_uses(fake, known, "sera_jax.harness.fake") == [
      "sera_jax.harness.fake uses sera_jax.method.allocation._check",
      "sera_jax.harness.fake uses sera_jax.method.validation._hidden"]


# ----------------------------------------------------------------------------- the package


def test_every_module_is_in_a_layer():
  stray = [name for name in modules_of("sera_jax")
           if name != "sera_jax" and name.split(".")[1] not in LAYERS
           and not in_verification(name) and name != TESTING]
  assert not stray, f"modules outside method/common/settings/harness and verification: {stray}"


def test_no_import_cycle():
  graph = import_graph(modules_of("sera_jax", "experiments"))
  assert find_cycle(graph) == []


def test_imports_run_only_downward():
  assert layer_violations(import_graph(modules_of("sera_jax"))) == []


def test_the_method_imports_only_jax_numpy_chex_and_the_standard_library():
  assert imports_beyond(modules_of("sera_jax/method"), METHOD_THIRD_PARTY,
                        ("sera_jax.method",)) == []


def test_the_testing_helpers_import_only_the_method():
  assert imports_beyond({TESTING: PACKAGE / "testing.py"}, TESTING_THIRD_PARTY,
                        ("sera_jax.method",)) == []


def test_the_reference_imports_only_numpy_scipy_and_the_standard_library():
  assert imports_beyond({REFERENCE: REFERENCE_FILE}, REFERENCE_THIRD_PARTY, ()) == []


def test_experiments_import_only_the_harness():
  graph = import_graph(modules_of("sera_jax", "experiments"))
  for name, targets in graph.items():
    if name.startswith("experiments"):
      assert all(t.startswith("sera_jax.harness") for t in targets), name


@pytest.mark.parametrize("name", sorted(modules_of("sera_jax")))
def test_every_module_imports(name):
  importlib.import_module(name)


def test_no_module_takes_a_private_name_from_another():
  known = set(modules_of("sera_jax"))
  uses = [use for path in modules_of("sera_jax").values() for use in private_uses(path, known)]
  assert uses == [], "private helpers used across modules; make them public or move them"
