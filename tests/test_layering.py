"""The package's layers import one way: ir <- passes <- backends <- sched <- frontend <- context
<- sampling <- cli (testing sits beside cli). Every import counts, also those inside functions and under
TYPE_CHECKING, so no layer names a type from above it."""

from __future__ import annotations

import ast
from pathlib import Path

import llamir

LAYERS = ["ir", "passes", "backends", "sched", "frontend", "context", "sampling", "testing", "cli"]
ROOT = Path(llamir.__file__).parent


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "llamir" or len(parts) < 2:
        return None
    head = parts[1]
    if head.startswith("cli"):
        return LAYERS.index("cli")
    return LAYERS.index(head) if head in LAYERS else None


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def test_layers_import_downwards_only():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = "llamir." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
        own = _layer(module)
        if own is None:
            continue
        for line, target in _imports(path):
            layer = _layer(target)
            if layer is not None and layer > own and not (LAYERS[own] == "testing" and LAYERS[layer] == "cli"):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} ({LAYERS[own]}) imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


PUBLIC = {"llamir", "llamir.backends", "llamir.ir", "llamir.testing.backend_ops"}


def test_plugins_use_only_the_public_api():
    """A plugin imports llamir's packages, never their modules (what they re-export is the API)."""
    plugins = ROOT.parent / "plugins"
    wrong = []
    for path in sorted(plugins.rglob("*.py")):
        for line, target in _imports(path):
            if target.startswith("llamir") and not target.startswith("llamir_") and target not in PUBLIC:
                wrong.append(f"{path.relative_to(plugins)}:{line} imports {target}")
    assert list(plugins.rglob("*.py")) and not wrong, "\n".join(wrong)
