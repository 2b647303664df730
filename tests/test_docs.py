"""The README is for users and short; the rest of the documentation is in docs/, every section the
README once held is there, and every link between them leads somewhere."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

# The README's sections before it was cut down to a user's README: each one is now a heading of
# the README or of a page in docs/.
FORMER_SECTIONS = [
    "Quick start", "`onnxfuse optimize IN OUT`", "`onnxfuse profile MODEL [MODEL2]`", "`onnxfuse passes`",
    "`onnxfuse zoo`", "`onnxfuse info`", "Exit codes", "Python API", "How it works", "Patterns and rules",
    "Layout", "Passes", "Fused ops and the native library", "Model zoo", "`onnxfuse fuzz`", "Benchmarks",
    "The corpus: torch.onnx exports against the peers", "On the GPU (H100)", "Supported onnxruntime versions",
    "Choosing onnxruntime or onnxruntime-gpu", "Packaging and releases", "Development",
    "Run the optimized model in your application",
]


def _headings(text: str) -> list[str]:
    inside_code = False
    found = []
    for line in text.splitlines():
        if line.startswith("```"):
            inside_code = not inside_code
        elif not inside_code and line.startswith("#"):
            found.append(line.lstrip("#").strip())
    return found


def _slugs(text: str) -> set[str]:
    """Anchors as GitHub makes them: lower case, punctuation dropped, spaces to hyphens, -1, -2
    for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _headings(text):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_short_and_has_contents():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines"
    assert any(line.startswith("**Contents:**") for line in lines[:40])
    text = README.read_text()
    written = text.split("<!-- bench:start -->")[0] + text.split("<!-- bench:end -->")[1]  # not the generated part
    longest = max(len(line) for line in written.splitlines() if not line.startswith("|"))
    assert longest <= 250, longest


def test_every_former_readme_section_lives_in_the_readme_or_docs():
    headings = {h for page in PAGES for h in _headings(page.read_text())}
    missing = [s for s in FORMER_SECTIONS if s not in headings]
    assert not missing, f"sections in neither README.md nor docs/: {missing}"


def test_readme_keeps_the_quick_start_commands_verbatim():
    text = README.read_text()
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[cpu]' && onnxfuse optimize"
            " zoo:char_rnn char_rnn.opt.onnx") in text
    block = re.search(r"<!-- ci-test-command -->\n```sh\n(.*?)\n```\n<!-- /ci-test-command -->", text, re.S)
    assert block and block.group(1) == ("python3 -m venv .venv && . .venv/bin/activate && pip install -e"
                                        " '.[cpu,test]' && pytest -q")
    assert "/char_rnn.opt.onnx" in (REPO / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_and_anchor_resolves(page):
    text = page.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest.read_text()):
            broken.append(target)
    assert not broken, f"{page.name}: links that lead nowhere: {broken}"


def test_places_for_further_results_are_marked():
    text = README.read_text()
    assert "<!-- exit-codes: add new statuses" in text and "<!-- results: add measured rows" in text
    assert "<!-- versions: add a row per onnxruntime release" in (REPO / "docs" / "install.md").read_text()
