"""The README and the pages of docs/: their Python runs, their links resolve, nothing is lost.

* Every ```python block runs as written and prints what it shows.
* Every relative link and image path resolves from the page it is on, a `#heading` too.
* Every page of docs/ is listed in docs/index.md and in the README.
* `.ci/run` runs exactly the README's test command.
* Every `method.md#section` citation, in the code as in the pages, names a section of
  docs/method.md, the method's specification, and nothing points at the retired one.
"""

import os
import pathlib
import re
import unicodedata

import pytest

THIS = pathlib.Path(__file__).resolve()
REPO = THIS.parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, REPO / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
METHOD = DOCS / "method.md"
# The sections of the method's specification, in order; code and pages cite them by anchor.
METHOD_SECTIONS = [
    "the-estimator-and-its-scale", "the-waterline", "integer-rounding", "the-active-set",
    "weights-and-the-loss", "estimating-p", "classification-as-rl", "maze-navigation",
    "simulated-scenarios", "the-packages-layers",
    "llm-post-training", "the-score-of-a-sequence"]
CITING_SUFFIXES = (".py", ".md", ".toml", ".cff", ".sh")
# What .gitignore leaves out (and .git itself): build outputs and caches, never sources.
UNTRACKED_DIRS = {".git", ".venv", ".pytest_cache", ".ruff_cache", ".hypothesis", "__pycache__",
                  "build", "runs"}
# The specification before docs/method.md; only the history may still name it.
# Spelt in pieces so that a grep of the repository for the retired name finds no file at all.
RETIRED = ("DES" + "IGN", "../shared")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.M)
CITATION = re.compile(r"method\.md#([\w-]+)")


def _name(page: pathlib.Path) -> str:
  return str(page.relative_to(REPO))


def _python_blocks() -> list[tuple[str, int, str]]:
  """(page, index on the page, source) of every Python block."""
  return [(_name(page), index, source) for page in PAGES
          for index, source in enumerate(block for language, block in FENCE.findall(
              page.read_text()) if language == "python")]


def _prose(text: str) -> str:
  """`text` without fenced blocks and inline code, where brackets are not links."""
  return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
  kept = "".join(c for c in text
                 if c in " -_" or unicodedata.category(c)[0] in "LN")
  return kept.replace(" ", "-")


def broken_links(page: pathlib.Path) -> list[str]:
  """The relative links and images of `page` whose file, or heading, does not exist."""
  broken = []
  for target in LINK.findall(_prose(page.read_text())):
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked
      continue
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.exists():
      broken.append(f"{target}: no such file")
    elif anchor and resolved.suffix == ".md" and anchor not in {
        slug(h) for h in HEADING.findall(FENCE.sub("", resolved.read_text()))}:
      broken.append(f"{target}: no such heading")
  return broken


def test_the_pages_have_python_examples():
  assert {page for page, _, _ in _python_blocks()} >= {"README.md", "docs/library.md",
                                                       "docs/llm.md"}


@pytest.mark.parametrize("page, index, source", [
    # A block that trains a model through Tunix is an end-to-end run: the slow tier.
    pytest.param(*block, marks=[pytest.mark.slow] if "settings.llm" in block[2] else [],
                 id=f"{block[0]}:{block[1]}")
    for block in _python_blocks()])
def test_python_example_runs(page, index, source, capsys):
  exec(compile(source, f"{page} python block {index}", "exec"), {})  # noqa: S102
  assert capsys.readouterr().out  # every example prints what it shows


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_and_image_resolves(page):
  assert broken_links(page) == []


def test_the_link_check_sees_a_broken_link_image_and_heading(tmp_path):
  (tmp_path / "there.md").write_text("# A heading, with `code` (and more)\n")
  page = tmp_path / "page.md"
  page.write_text("[ok](there.md#a-heading-with-code-and-more) [web](https://example.com)\n"
                  "![gone](figures/none.png) [no](there.md#elsewhere) `[code](none.md)`\n"
                  "```\n[in a block](none.md)\n```\n")
  assert broken_links(page) == ["figures/none.png: no such file",
                                "there.md#elsewhere: no such heading"]


def test_every_docs_page_is_in_the_index_and_the_readme():
  pages = {page.name for page in DOCS.glob("*.md")} - {"index.md"}
  index = set(LINK.findall((DOCS / "index.md").read_text()))
  readme = set(LINK.findall(README.read_text()))
  assert pages - index == set()
  assert {f"docs/{name}" for name in pages} - readme == set()


def test_ci_runs_exactly_the_readmes_test_command():
  text = README.read_text()
  after = text[text.index("Run the whole test suite:"):]
  command = FENCE.search(after).group(2).strip()
  ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#")]
  assert ci[-1] == command == 'pip install -e ".[test,llm,sim]" && pytest'


def repository_files(root: pathlib.Path, suffixes: tuple[str, ...] | None = None
                     ) -> list[pathlib.Path]:
  """The files under `root` (with one of `suffixes`, if given), outside `UNTRACKED_DIRS`,
  egg-info and workdirs."""
  found = []
  # Pruned as it walks: the environment under .venv is never entered, and a directory that a
  # build deletes meanwhile is skipped (os.walk ignores what vanished).
  for directory, subdirectories, names in os.walk(root):
    subdirectories[:] = sorted(name for name in subdirectories if not (
        name in UNTRACKED_DIRS or name.endswith(".egg-info") or name.startswith("workdir")))
    found += [pathlib.Path(directory) / name for name in names
              if suffixes is None or pathlib.Path(name).suffix in suffixes]
  return sorted(found)


def unresolved_citations(paths: list[pathlib.Path], anchors: set[str]) -> list[str]:
  """'file:line: method.md#anchor' for each citation in `paths` of an anchor not in `anchors`."""
  return [f"{path}:{number}: method.md#{anchor}" for path in paths
          for number, line in enumerate(path.read_text().splitlines(), start=1)
          for anchor in CITATION.findall(line) if anchor not in anchors]


def retired_mentions(paths: list[pathlib.Path]) -> list[str]:
  """'file: word' for each file in `paths` that holds one of `RETIRED`."""
  return [f"{path}: {word}" for path in paths for word in RETIRED
          if word.encode() in path.read_bytes()]


def _section_anchors(page: pathlib.Path, level: str = "#") -> list[str]:
  """The anchors of `page`'s headings at `level` ("#" any, "##" sections only), in order."""
  text = FENCE.sub("", page.read_text())
  if level == "#":
    return [slug(heading) for heading in HEADING.findall(text)]
  return [slug(heading) for heading in re.findall(rf"^{level}\s+(.+?)\s*$", text, flags=re.M)]


def test_the_method_page_has_the_sections_the_code_cites():
  assert _section_anchors(METHOD, "##") == METHOD_SECTIONS


def test_every_method_citation_names_a_section_of_the_method_page():
  # CHANGELOG.md records history as it was; this file cites bad anchors on purpose.
  cited = [path for path in repository_files(REPO, CITING_SUFFIXES)
           if path not in (REPO / "CHANGELOG.md", THIS)]
  assert len(cited) > 50  # the package, its tests and its pages
  assert unresolved_citations(cited, set(_section_anchors(METHOD))) == []


def test_the_citation_check_sees_an_unknown_section(tmp_path):
  (tmp_path / "code.py").write_text('"""The waterline (docs/method.md#the-waterline)."""\n')
  page = tmp_path / "page.md"
  page.write_text("[the waterline](method.md#the-waterline)'s float\n"
                  "see docs/method.md#the-waterlines and method.md#the-waterline.\n")
  assert unresolved_citations(repository_files(tmp_path, CITING_SUFFIXES),
                              {"the-waterline"}) == [f"{page}:2: method.md#the-waterlines"]


def test_the_file_walk_skips_build_outputs_and_caches(tmp_path):
  for name in ("a.py", "docs/b.md", ".ci/run", "notes.txt", ".venv/lib/c.py", ".git/d.sh",
               "pkg.egg-info/e.py", "workdir-1/f.py", "build/g.py"):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("x\n")
  found = lambda suffixes: [str(path.relative_to(tmp_path))  # noqa: E731
                            for path in repository_files(tmp_path, suffixes)]
  assert found(CITING_SUFFIXES) == ["a.py", "docs/b.md"]
  assert found(None) == [".ci/run", "a.py", "docs/b.md", "notes.txt"]


def test_nothing_outside_the_history_names_the_retired_specification():
  # This file names the retired words to look for them; CHANGELOG.md keeps the history.
  files = [path for path in repository_files(REPO) if path not in (REPO / "CHANGELOG.md", THIS)]
  assert retired_mentions(files) == []


def test_the_retired_check_sees_either_word(tmp_path):
  paths = [tmp_path / name for name in ("clean.md", "spec.py", "path.sh")]
  for path, text in zip(paths, ("# Design notes, in docs/method.md\n",
                                f"# the method, see {RETIRED[0]} §1\n",
                                "cat ../shared/notes\n"), strict=True):
    path.write_text(text)
  assert retired_mentions(paths) == [f"{paths[1]}: {RETIRED[0]}", f"{paths[2]}: ../shared"]
