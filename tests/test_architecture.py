"""docs/architecture.md's picture is the code's own import graph, part by part."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("placement", "worker", "tasks")


def part(module: str) -> str:
    """`placement.ledger.registry` -> `placement.ledger`; `worker.node` -> `worker`."""
    pieces = module.split(".")
    return ".".join(pieces[:2]) if pieces[0] != "worker" and len(pieces) > 1 else pieces[0]


def code_edges() -> set[tuple[str, str]]:
    """Which part imports which, inside each package, and between the packages."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    graph = grimp.build_graph(*PACKAGES)
    edges: set[tuple[str, str]] = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = part(module), part(imported)
            top_a, top_b = a.split(".")[0], b.split(".")[0]
            if top_b not in PACKAGES or b == "placement.errors":
                continue
            if top_a != top_b:
                edges.add((top_a, top_b))
            elif a != b:
                edges.add((a, b))
    return edges


def drawn_edges() -> set[tuple[str, str]]:
    """The arrows of the mermaid picture, with its node ids read as module paths."""
    text = (REPO / "docs/architecture.md").read_text()
    picture = text.split("```mermaid", 1)[1].split("```", 1)[0]
    edges: set[tuple[str, str]] = set()
    for left, right in re.findall(r"^\s*(\w+) --> (.+)$", picture, flags=re.M):
        for target in right.split("&"):
            edges.add((left.replace("_", ".", 1), target.strip().replace("_", ".", 1)))
    return edges


def test_the_architecture_picture_draws_exactly_the_imports_between_parts() -> None:
    drawn, code = drawn_edges(), code_edges()
    assert drawn == code, {"drawn, not in the code": drawn - code, "not drawn": code - drawn}


def test_every_path_the_architecture_page_names_exists() -> None:
    text = (REPO / "docs/architecture.md").read_text()
    paths = set(
        re.findall(r"`((?:placement|tasks|worker|bench|scripts|docs|tests)/[\w/.]*)`", text)
    )
    modules = set(re.findall(r"`((?:placement|tasks|worker)(?:\.\w+)+)", text))
    assert paths and modules
    for path in paths:
        assert (REPO / path).exists(), path
    for module in modules:
        parts = module.split(".")
        while parts and not (
            REPO.joinpath(*parts).with_suffix(".py").exists() or REPO.joinpath(*parts).is_dir()
        ):
            parts.pop()  # a name inside a module: `Registry.pick`
        assert len(parts) >= 2, module


def _exists(parts: list[str]) -> bool:
    where = REPO.joinpath(*parts)
    return where.with_suffix(".py").exists() or where.is_dir()
