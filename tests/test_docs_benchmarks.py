"""The measurements stay legible (issue 49): docs/performance.md holds today's answers in at most 300 lines, every
script in benchmarks/ runs as a `python -m benchmarks` subcommand, and every link to a heading of performance.md or
performance-history.md lands on one. Read from the files with `ast` and regular expressions: nothing is imported."""

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

from conftest import REPO

MAX_PERFORMANCE_LINES = 300
DOCS = REPO / "docs"
BENCHMARKS = REPO / "benchmarks"
PERFORMANCE_DOCS = ("performance.md", "performance-history.md")
# Where links to those pages are written: the markdown everywhere, and the sources' comments and docstrings.
LINKING_ROOTS = ("README.md", "docs", "llama", "benchmarks", "tests", "example_chat_completion.py",
                 "example_text_completion.py")
LINK = re.compile(r"(performance(?:-history)?\.md)#([^\s)\]\"'`>,]+)")
IN_PAGE_LINK = re.compile(r"\]\(#([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: link syntax reduced to its text, lowercase, punctuation dropped except
    '-' and '_', spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> Set[str]:
    """Every heading anchor of a page, outside fenced code; a repeated heading's anchors get -1, -2, ... as on
    GitHub."""
    found: Set[str] = set()
    count: Dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r" {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
        if match:
            base = slug(match.group(1))
            count[base] = count.get(base, 0) + 1
            found.add(f"{base}-{count[base] - 1}" if count[base] > 1 else base)
    return found


def linking_files() -> List[Path]:
    """The files under LINKING_ROOTS that may link to a performance page; not this one, whose links are examples."""
    files = []
    for root in LINKING_ROOTS:
        path = REPO / root
        files += [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.suffix in (".md", ".py")]
    return [f for f in files if f.resolve() != Path(__file__).resolve()]


def broken_links(path: Path) -> List[str]:
    """'page#anchor' for every link in path to a performance page's heading that the page lacks (the pages' own
    in-page links included)."""
    pages = {name: anchors((DOCS / name).read_text()) for name in PERFORMANCE_DOCS}
    text = path.read_text(errors="replace")
    links: List[Tuple[str, str]] = LINK.findall(text)
    if path.parent == DOCS and path.name in pages:
        links += [(path.name, anchor) for anchor in IN_PAGE_LINK.findall(text)]
    return [f"{page}#{anchor}" for page, anchor in links if anchor not in pages[page]]


def registry() -> Dict[str, Tuple[str, str]]:
    """benchmarks/__main__.py's MEASUREMENTS (name -> (module, what it measures)), as written in the source."""
    tree = ast.parse((BENCHMARKS / "__main__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MEASUREMENTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("benchmarks/__main__.py has no MEASUREMENTS")


def is_main_guard(node: ast.AST) -> bool:
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.comparators) == 1):
        return False
    sides = [node.test.left, node.test.comparators[0]]
    return ({getattr(s, "id", None) for s in sides} >= {"__name__"}
            and {getattr(s, "value", None) for s in sides} >= {"__main__"})


def is_script(path: Path) -> bool:
    """A module that runs as a program: it defines main() or has an `if __name__ == "__main__":` block."""
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" or is_main_guard(n) for n in tree.body)


def unregistered_scripts() -> List[str]:
    registered = {module for module, _ in registry().values()}
    return sorted(p.name for p in BENCHMARKS.glob("*.py")
                  if p.stem not in ("__main__", "__init__") and is_script(p) and p.stem not in registered)


def test_performance_md_holds_at_most_300_lines():
    lines = len((DOCS / "performance.md").read_text().splitlines())
    assert lines <= MAX_PERFORMANCE_LINES, (
        f"docs/performance.md has {lines} lines (at most {MAX_PERFORMANCE_LINES}): keep the newest answer to each "
        "question there and move the older runs and narratives, verbatim, to docs/performance-history.md")


def test_every_benchmark_script_is_a_subcommand():
    missing = unregistered_scripts()
    assert not missing, (
        f"benchmarks/{', benchmarks/'.join(missing)}: a script (main() or a __main__ block) that "
        "`python -m benchmarks` does not reach; add it to MEASUREMENTS in benchmarks/__main__.py, or remove its "
        "main and __main__ block if it is a library")


def test_every_subcommand_names_a_module_with_a_main():
    for name, (module, what) in registry().items():
        path = BENCHMARKS / f"{module}.py"
        assert path.is_file() and is_script(path), f"{name}: benchmarks/{module}.py is not a script"
        assert what.strip(), f"{name} has no help line"


def test_links_to_performance_headings_resolve():
    files = linking_files()
    assert REPO / "docs" / "formats.md" in files and REPO / "docs" / "performance.md" in files
    broken = [f"{path.relative_to(REPO)}: {link}" for path in files for link in broken_links(path)]
    assert not broken, "links to headings that docs/performance*.md lack (GitHub anchors): " + "; ".join(broken)


def test_the_checks_see_what_they_should():
    """The checkers themselves: GitHub's anchors, a link to a missing heading, scripts told from libraries."""
    assert slug('compile="auto"') == "compileauto"
    assert slug("Speculative decoding (prompt lookup)") == "speculative-decoding-prompt-lookup"
    assert slug("GGUF block formats at 7B (issue 36)") == "gguf-block-formats-at-7b-issue-36"
    assert slug("SmolLM2 Q4_1: `x` and [a link](y.md)") == "smollm2-q4_1-x-and-a-link"
    assert anchors("# A\n## A\n```\n# B\n```\n### A ##\n") == {"a", "a-1", "a-2"}
    assert is_script(BENCHMARKS / "gguf_blocks.py") and not is_script(BENCHMARKS / "harness.py")
    assert is_main_guard(ast.parse('if "__main__" == __name__:\n    pass').body[0])


def test_a_link_to_a_missing_heading_is_reported(tmp_path):
    note = tmp_path / "note.md"
    note.write_text("[a](performance.md#no-such-heading), [b](docs/performance.md#first-run), "
                    "[c](performance-history.md#moved-from-performancemd-2026-11-28), [d](performance-history.md#x)\n")
    assert broken_links(note) == ["performance.md#no-such-heading", "performance-history.md#x"]
