"""The public boundary: ``parallel_lora``, ``parallel_lora.tp`` and ``parallel_lora.hf`` with explicit ``__all__``;
``launch/`` and ``benchmarks/`` import nothing else of the library."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import parallel_lora

REPO = Path(__file__).resolve().parents[1]
PUBLIC = ("parallel_lora", "parallel_lora.tp", "parallel_lora.hf")


def _library_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import of the library in ``path`` (``name`` None for ``import module``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "parallel_lora"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "parallel_lora":
            found += [(node.lineno, node.module, a.name) for a in node.names]
    return found


def _boundary_breaches(path: Path) -> list[str]:
    breaches = []
    for line, module, name in _library_imports(path):
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line}"
        if module not in PUBLIC:
            breaches.append(f"{where} imports the non-public module {module}")
        elif name is not None and name not in importlib.import_module(module).__all__:
            breaches.append(f"{where} imports {module}.{name}, which is not in its __all__")
    return breaches


@pytest.mark.parametrize("folder", ["launch", "benchmarks"])
def test_launcher_and_benchmarks_import_only_public_names(folder):
    sources = sorted(p for p in (REPO / folder).rglob("*.py") if not p.name.startswith("test_"))
    assert sources, f"no sources under {folder}/"
    breaches = [b for p in sources for b in _boundary_breaches(p)]
    assert not breaches, "\n".join(breaches)


def test_boundary_check_catches_a_private_import(tmp_path):
    # The check is not vacuous: a private module and a name outside __all__ are both reported.
    src = tmp_path / "probe.py"
    src.write_text("from parallel_lora._files import replace_file\nfrom parallel_lora.tp import LoRALayer\n")
    assert len(_boundary_breaches(src)) == 2, _boundary_breaches(src)


@pytest.mark.parametrize("module", PUBLIC)
def test_every_name_in_all_imports(module):
    mod = importlib.import_module(module)
    assert mod.__all__ and len(set(mod.__all__)) == len(mod.__all__), mod.__all__
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing, f"{module}.__all__ names what it does not define: {missing}"


def test_library_modules_come_from_this_checkout():
    # A module path that no longer exists must fail to import, not resolve through another installed copy.
    for module in PUBLIC:
        importlib.import_module(module)
    root = Path(parallel_lora.__file__).resolve().parent
    elsewhere = [name for name, m in sys.modules.items() if name.split(".")[0] == "parallel_lora"
                 and getattr(m, "__file__", None) and root not in Path(m.__file__).resolve().parents]
    assert not elsewhere, f"imported from outside {root}: {elsewhere}"
