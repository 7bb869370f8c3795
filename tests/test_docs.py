"""The documentation a clone carries: the README is a map, the flag reference is the parser's
own, every link and cited source file resolves inside the repository, and no file points
at a document the repository does not hold."""

from __future__ import annotations

import os
import re
from pathlib import Path

from lmsp_mlx import flags

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "kernels" / "README.md",
         ROOT / "models" / "README.md", ROOT / "benchmarks" / "results" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
SOURCE = re.compile(r"`((?:lmsp_mlx|kernels|benchmarks|tests)/[\w/.-]+\.(?:py|c|cu|metal|h|sh))`")
# Names of documents that live outside this repository (design notes, specifications).
# Built from parts so that this file does not match itself.
OUTSIDE = re.compile("|".join([r"PROTOCOL" + r"\.md", r"FACTS" + r"\.md", r"ARCHITECTURE" + r"\.md",
                               r"DEVELOPERS" + r"\.md", r"\bdesign" + r"/", r"\.\./shared",
                               r"responses-continuation" + r"-plan"]))
ABSOLUTE = re.compile(r"(?:/tmp|/home|/Users|/work|/private/var)/")
TEXT = {".py", ".md", ".toml", ".sh", ".c", ".cu", ".h", ".metal", ".txt", ".cfg", ".csv"}
SKIP = {".git", ".venv", "__pycache__", ".pytest_cache", "build", "node_modules"}


def repository_files() -> list[Path]:
    """Every text file a clone holds, less virtual environments, caches and the model store's
    downloaded models (models/ keeps only its README in git)."""
    out = [ROOT / "models" / "README.md"]
    for folder, dirs, files in os.walk(ROOT):
        here = Path(folder)
        dirs[:] = [d for d in dirs if d not in SKIP and not d.endswith(".egg-info")
                   and not (here == ROOT and d == "models")]
        out += [here / f for f in files if Path(f).suffix in TEXT]
    return out


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces to -."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def test_readme_is_a_map_of_at_most_300_lines():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for page in ("api", "clients", "models", "architecture", "kv-cache", "batching", "cpu-backend",
                 "kernels", "benchmarks", "flags"):
        assert f"docs/{page}.md" in readme, f"the README's map lacks docs/{page}.md"
        assert (ROOT / "docs" / f"{page}.md").is_file()


def test_the_flag_reference_is_generated_from_the_parser():
    written = (ROOT / "docs" / "flags.md").read_text()
    assert written == flags.markdown(), "docs/flags.md is stale: python -m lmsp_mlx.flags > docs/flags.md"
    for action in flags.parser()._actions:  # every flag a user can pass is on the page
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert f"`{option}" in written, option


def test_every_link_between_pages_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_source_file_the_docs_name_exists():
    missing = [f"{page.relative_to(ROOT)}: {name}" for page in PAGES
               for name in SOURCE.findall(page.read_text()) if not (ROOT / name).exists()]
    assert not missing, "\n".join(missing)


def test_no_file_refers_to_a_document_outside_the_repository():
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in repository_files()
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if OUTSIDE.search(line)]
    assert not hits, "\n".join(hits)


def test_no_committed_result_holds_an_absolute_path():
    results = ROOT / "benchmarks" / "results"
    hits = [f"{path.name}:{n}" for path in sorted(results.iterdir()) if path.suffix in (".csv", ".md")
            for n, line in enumerate(path.read_text().splitlines(), 1) if ABSOLUTE.search(line)]
    assert not hits, hits
