"""packaging/bundle_modules.py, the modules gapless.spec leaves out, checked without a build: no module that loads
GNU readline (GPL-3) or the ncurses libraries for a terminal prompt goes into the bundle, from Python's own
extension modules or from transformers' command-line tools."""

from __future__ import annotations

import importlib.util
import re
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The libraries of an interactive terminal: line editing (GNU readline, GPL-3; libedit) and curses.
TERMINAL_LIBRARIES = re.compile(rb"lib(readline|edit|ncursesw?|panelw?|tinfo)\.so")


@pytest.fixture(scope="module")
def modules():
    spec = importlib.util.spec_from_file_location("gapless_bundle_modules", ROOT / "packaging" / "bundle_modules.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def excluded(name: str, excludes: list[str]) -> bool:
    """Whether PyInstaller leaves the module out: it or a package above it is excluded."""
    return any(name == x or name.startswith(x + ".") for x in excludes)


def test_no_extension_module_of_python_s_that_loads_a_terminal_library_goes_in(modules):
    """readline (libreadline.so.8, GPL-3, and libtinfo) and curses (libncursesw) went in: Python's readline and
    curses modules are optional imports of pdb, code, cmd and transformers' chat prompt."""
    dynload = Path(sysconfig.get_config_var("DESTSHARED") or "")
    if not dynload.is_dir():
        pytest.skip("this Python has no folder of shared extension modules")
    found = {}
    for path in dynload.glob("*.so"):
        linked = sorted({m.group(0).decode() for m in TERMINAL_LIBRARIES.finditer(path.read_bytes())})
        if linked:
            found[path.name.split(".")[0]] = linked
    kept = {name: libs for name, libs in found.items() if not excluded(name, modules.EXCLUDES)}
    assert kept == {}, f"these would take their libraries into the bundle: {kept}"


def test_transformers_command_line_tools_stay_out(modules):
    """transformers 5 moved its command-line tools from transformers.commands to transformers.cli, and the spec
    went on leaving out only the former: `transformers chat`, whose prompt imports readline, went in."""
    transformers = importlib.util.find_spec("transformers")
    assert transformers is not None and transformers.submodule_search_locations
    top = Path(next(iter(transformers.submodule_search_locations)))
    prompt = re.compile(r"^\s*(import|from)\s+(readline|curses)\b", re.M)
    kept = []
    for source in top.rglob("*.py"):
        parts = source.relative_to(top.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if modules.transformers_module_wanted(name) and not excluded(name, modules.EXCLUDES):
            if prompt.search(source.read_text(encoding="utf-8", errors="replace")):
                kept.append(name)
    assert kept == []
    assert not modules.transformers_module_wanted("transformers.cli.chat")
    assert modules.transformers_module_wanted("transformers.models.llama.modeling_llama")
    assert modules.transformers_module_wanted("transformers.cliplike")  # a name that only starts the same


def test_every_module_the_code_imports_is_a_requirement_s_or_left_out(modules):
    """keyring (and cryptography, jeepney, ... with it) and llama_cpp went into a bundle built where they were
    installed: optional imports of the code, whose distributions the licence collection (the requirements,
    followed through theirs) never saw, so the bundle carried them without their licences."""
    import ast
    import importlib.metadata as md
    import sys

    sys.path.insert(0, str(ROOT / "packaging"))
    try:
        from licences import runtime_distributions
    finally:
        sys.path.pop(0)
    required = {md.Distribution.metadata.fget(d)["Name"].lower().replace("_", "-") for d in runtime_distributions()}
    owners = md.packages_distributions()
    imported = set()
    for folder in ("app", "engine", "ui"):
        for source in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
    ours = {"app", "engine", "ui", "assets"}
    outside = sorted(
        n for n in imported - ours if n not in sys.stdlib_module_names and not excluded(n, modules.EXCLUDES)
    )
    unlicensed = {
        n: owners.get(n, ["not installed here"])
        for n in outside
        if not any(d.lower().replace("_", "-") in required for d in owners.get(n, []))
    }
    assert unlicensed == {}, f"imported, not a requirement, not left out of the bundle: {unlicensed}"
