"""The README and the pages of docs/: their Python runs, their links resolve, nothing is lost.

* Every ```python block runs as written and prints what it shows.
* Every relative link and image path resolves from the page it is on, a `#heading` too.
* Every page of docs/ is listed in docs/index.md and in the README.
* `.ci/run` runs exactly the README's test command.
"""

import pathlib
import re
import unicodedata

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, REPO / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.M)


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
  assert ci[-1] == command == 'pip install -e ".[test,llm]" && pytest'
