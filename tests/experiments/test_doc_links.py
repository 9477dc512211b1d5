"""Every link of the repository's Markdown between its own files leads somewhere: the file exists,
and a #anchor names a heading of the page it points to (as GitHub makes anchors of headings). The
report templates in experiments/ are left out: their links resolve from the folder each report is
written to, and the reports written from them are checked here as they are committed."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files():
    tracked = subprocess.run(["git", "ls-files", "*.md"], capture_output=True, text=True, cwd=ROOT, check=True)
    return [ROOT / f for f in tracked.stdout.split() if not re.fullmatch(r"experiments/.*_report\.md", f)]


def prose(path):
    return CODE_BLOCK.sub("", path.read_text(encoding="utf-8"))


def anchors(path):
    """GitHub's anchor of each heading: lower case, punctuation but - and _ dropped, spaces to -."""
    headings = re.findall(r"^#+ (.+)$", prose(path), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def broken_links(path):
    broken = []
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    return broken


def test_every_link_between_the_repositorys_pages_leads_somewhere():
    files = markdown_files()
    assert ROOT / "README.md" in files and len(files) > 10
    broken = {str(f.relative_to(ROOT)): b for f in files if (b := broken_links(f))}
    assert not broken, broken


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title `x`\n\n## Over seeds\n\n```sh\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#over-seeds) [ok](a.md#title-x) [ok](#here) [web](https://example.org)\n"
        "[gone](c.md) [no heading](a.md#not-a-heading) [no heading](#nowhere)\n\n## Here\n"
    )
    assert broken_links(page) == [
        "c.md: no such file",
        "a.md#not-a-heading: no such heading",
        "#nowhere: no such heading",
    ]
