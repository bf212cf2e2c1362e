"""mkdocs hooks (mkdocs.yml's `hooks:`): the site's home page is the README, so what the README
says is said once. Its links are written for the repository (`docs/guide.md`, `CHANGELOG.md`);
on the site a page of docs/ is linked as a page and any other file of the repository by its
address in the repository (`repo_url`). Links from docs/ out of it (`../CHANGELOG.md`) get the
same treatment. pyproject.toml's long description rewrites the README's links to the same
places with absolute addresses (tests/contract/test_package.py checks it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
# A Markdown link's target: ](target) or ](target#anchor), not an address (http:, mailto:).
LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:)(?P<path>[^)#\s]*)(?P<anchor>#[^)\s]*)?\)", re.I)


def repository_link(config: Any, path: str) -> str:
    """Where a file of the repository is read on the repository's site (a picture as itself,
    so that a page can show it)."""
    view = "raw" if Path(path).suffix in (".png", ".svg", ".jpg") else "blob"
    return f"{config['repo_url'].rstrip('/')}/{view}/main/{path}"


def rewrite(text: str, config: Any, base: str) -> str:
    """The Markdown with each relative link to a file outside docs/ (relative to the folder
    `base` of the repository) pointed at the site's page or the repository's file."""

    def target(match: re.Match[str]) -> str:
        path, anchor = match["path"], match["anchor"] or ""
        if not path:
            return match[0]  # an anchor on the same page
        resolved = (ROOT / base / path).resolve().relative_to(ROOT).as_posix()
        if resolved == "README.md":
            return f"](index.md{anchor})"
        if resolved.startswith("docs/"):
            return f"]({Path(resolved).relative_to('docs').as_posix()}{anchor})"
        return f"]({repository_link(config, resolved)}{anchor})"

    return LINK.sub(target, text)


def on_files(files: Files, config: Any) -> Files:
    readme = (ROOT / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=rewrite(readme, config, ".")))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri == "index.md":
        return markdown  # rewritten when it was made
    return rewrite(markdown, config, "docs")
