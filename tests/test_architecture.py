"""The layering rules of docs/DEVELOPERS.md ("Architecture rules"), checked over every import of the shipped code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Plain data and pure functions over it (the diagnosis reads a generation's figures), and the file writing that
# is whole or nothing (an export); nothing that runs a model.
UI_MAY_IMPORT_FROM_ENGINE = {
    "engine",
    "engine.types",
    "engine.figures",
    "engine.errors",
    "engine.diagnosis",
    "engine.paths",
}
PLAIN_ENGINE_MODULES = ("types", "figures", "errors", "diagnosis", "paths")
HEAVY = {"torch", "transformers", "gguf", "safetensors", "triton"}
QT = {"PySide6", "pyqtgraph", "shiboken6"}
APP_GUI_BUILDERS = {"app/gui.py", "app/replay.py"}  # the app modules that build widgets
# Who runs the garbage collector's passes and turns automatic collection on and off: in the app every pass runs
# on the GUI thread (a pass on the engine worker freed Qt objects there and crashed it), so the rest asks heap.
GC_OWNERS = {"engine/heap.py", "app/collector.py"}
GC_CONTROLS = {"collect", "enable", "disable"}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, at any depth (a function-level import counts too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == "engine":  # `from engine import figures` names a module
                out += [(node.lineno, f"engine.{a.name}") for a in node.names]
    return out


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.glob("*/**/*.py")):
        rel = path.relative_to(root).as_posix()
        package = rel.split("/", 1)[0]
        if package not in ("engine", "ui", "app"):
            continue
        for line, module in imports(path):
            top = module.split(".", 1)[0]
            where = f"{rel}:{line} imports {module}"
            if package == "engine" and (top in QT or top in ("app", "ui")):
                found.append(f"{where}: the engine never imports Qt, pyqtgraph, app or ui")
            if package == "ui":
                if top == "engine" and module not in UI_MAY_IMPORT_FROM_ENGINE:
                    found.append(f"{where}: ui/ imports only the engine's plain-data modules")
                if top in HEAVY:
                    found.append(f"{where}: ui/ never imports the inference stack")
            if package == "app" and top == "ui" and rel not in APP_GUI_BUILDERS:
                found.append(f"{where}: only the GUI builders in app/ import widgets")
        if rel not in GC_OWNERS:
            for line, name in gc_controls(path):
                found.append(f"{rel}:{line} calls gc.{name}: collections go through engine.heap (heap.collect())")
    return found


def gc_controls(path: Path) -> list[tuple[int, str]]:
    """(line, name) for every call of `gc.collect()`, `gc.enable()` or `gc.disable()` in the file, the module
    imported under another name too, and every `from gc import` of one of them (its calls are then plain names)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = {"gc"} | {
        a.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for a in node.names
        if a.name == "gc" and a.asname
    }
    found = [
        (node.lineno, a.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "gc"
        for a in node.names
        if a.name in GC_CONTROLS or a.name == "*"
    ]
    found += [
        (node.lineno, node.func.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in names
        and node.func.attr in GC_CONTROLS
    ]
    return sorted(found)


def test_the_shipped_code_keeps_the_layers():
    assert violations(ROOT) == []


def test_the_engine_modules_the_ui_may_read_import_no_inference_stack():
    for name in PLAIN_ENGINE_MODULES:
        path = ROOT / "engine" / f"{name}.py"
        heavy = [m for _, m in imports(path) if m.split(".", 1)[0] in HEAVY | QT]
        assert heavy == [], f"engine/{name}.py imports {heavy}: the UI may not read it then"


@pytest.mark.parametrize(
    "rel, source, rule",
    [
        ("engine/x.py", "from PySide6.QtCore import QObject\n", "never imports Qt"),
        ("engine/x.py", "def f():\n    import pyqtgraph\n", "never imports Qt"),
        ("engine/x.py", "from ui.hud import fmt\n", "never imports Qt, pyqtgraph, app or ui"),
        ("engine/telemetry/x.py", "import app.worker\n", "never imports Qt, pyqtgraph, app or ui"),
        ("ui/x.py", "from engine.decode import StaticRunner\n", "plain-data modules"),
        ("ui/x.py", "from engine import generate\n", "plain-data modules"),
        ("ui/hud/x.py", "import torch\n", "inference stack"),
        ("app/cmd_x.py", "from ui.main_window import MainWindow\n", "GUI builders"),
        ("engine/x.py", "import gc\n\ndef close():\n    gc.collect()\n", "go through engine.heap"),
        ("app/worker.py", "import gc\ngc.disable()\n", "go through engine.heap"),
        ("engine/x.py", "import gc as collector\ncollector.collect(2)\n", "go through engine.heap"),
        ("app/x.py", "from gc import collect\n\ndef close():\n    collect()\n", "go through engine.heap"),
    ],
)
def test_each_rule_catches_its_violation(tmp_path, rel, source, rule):
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")
    (tmp_path / "ui").mkdir(exist_ok=True)
    (tmp_path / "ui" / "ok.py").write_text("from engine.types import EngineOptions\nfrom engine import figures\n")
    found = violations(tmp_path)
    assert len(found) == 1 and rule in found[0], found
