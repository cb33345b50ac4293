"""Which modules the exporter runs compiled, and where they run that way.

The exporter's per-trace path (unpacking, the breakdown, signal windows, the diagnosis, metric aggregation,
the keep decision, span and OTLP building) is compiled ahead of time from these very ``.py`` files with
Cython in pure-Python mode where a C compiler was there at install (``hatch_build.py``); the extension
modules sit beside the sources, which stay the fallback. They load in the exporter process only: the
application process always imports the sources (a tracer that can crash the service it observes is worse
than a slower one), and ``STAGETRACE_PURE_PYTHON=1`` makes the exporter import them too.

How: Python prefers an extension module to a source file of the same name, so every process but an
exporter allowed to run compiled puts ``SourceFirst`` at the head of ``sys.meta_path``, which hands the
import system the ``.py`` of each listed module. Standard library only: ``hatch_build.py`` reads the list.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

# The modules compiled, one table: the exporter's per-trace path and what it calls for every trace.
COMPILED_MODULES = (
    "stagetrace.analysis.breakdown",
    "stagetrace.analysis.causes",
    "stagetrace.analysis.diagnosis",
    "stagetrace.analysis.loopwait",
    "stagetrace.analysis.model",
    "stagetrace.analysis.offload",
    "stagetrace.analysis.signals",
    "stagetrace.analysis.stage_record",
    "stagetrace.analysis.streams",
    "stagetrace.analysis.thresholds",
    "stagetrace.analysis.verdict",
    "stagetrace.common.decimals",
    "stagetrace.common.schedstat",
    "stagetrace.common.wire",
    "stagetrace.exporter.aggregation",
    "stagetrace.exporter.budget",
    "stagetrace.exporter.core",
    "stagetrace.exporter.diagnosis_budget",
    "stagetrace.exporter.foreign",
    "stagetrace.exporter.keep",
    "stagetrace.exporter.metrics",
    "stagetrace.exporter.offload",
    "stagetrace.exporter.otlp_encoding",
    "stagetrace.exporter.signals",
    "stagetrace.exporter.spans",
)

PURE_PYTHON_VARIABLE = "STAGETRACE_PURE_PYTHON"  # "1": the sources everywhere, the exporter included
# Set by the application in its exporter process's environment (handoff/transport.py): this process may run
# the compiled modules. Internal (one process to its child), hence the leading underscore.
EXPORTER_VARIABLE = "_STAGETRACE_EXPORTER_PROCESS"


def pure_python_forced(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(PURE_PYTHON_VARIABLE, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def _extension_beside(source: str) -> str | None:
    stem = source[: -len(".py")]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.isfile(stem + suffix):
            return stem + suffix
    return None


def _built_since(built: str, source: str) -> bool:
    """The extension ``built`` is no older than ``source`` and the ``.pxd`` beside it (which types it where
    Cython compiles it: a change there alone makes it stale too)."""
    declared = source[: -len(".py")] + ".pxd"
    newest = max(os.path.getmtime(source), os.path.getmtime(declared) if os.path.isfile(declared) else 0.0)
    return os.path.getmtime(built) >= newest


class SourceFirst(importlib.abc.MetaPathFinder):
    """Finds the ``.py`` of each listed module, so that the extension module beside it is not loaded: always, or
    with ``stale_only`` (an exporter allowed to run compiled) where any listed module is stale: its extension
    missing, or built before its source or its ``.pxd`` changed (a checkout being edited). All of them then,
    not that one alone: a compiled module calls another's functions in C (a ``cimport``), and imports only
    when that one is the extension it was compiled against."""

    def __init__(self, names: Sequence[str] = COMPILED_MODULES, *, stale_only: bool = False) -> None:
        self.names = frozenset(names)
        self.stale_only = stale_only
        self._any_stale: bool | None = None  # found at the first listed import, from where that one lives

    def _some_stale(self, fullname: str, directory: str) -> bool:
        if self._any_stale is None:
            root = directory
            for _ in range(fullname.count(".")):  # ``directory`` holds ``fullname``: up to where its top package is
                root = os.path.dirname(root)
            sources = [os.path.join(root, *name.split(".")) + ".py" for name in self.names]
            self._any_stale = not all(
                (built := _extension_beside(source)) is not None and _built_since(built, source)
                for source in sources
                if os.path.isfile(source)
            )
        return self._any_stale

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        leaf = fullname.rpartition(".")[2] + ".py"
        for entry in path or sys.path:
            source = os.path.join(entry, leaf)
            if os.path.isfile(source):
                if self.stale_only and not self._some_stale(fullname, entry):
                    return None  # every one built from its very source: the usual import loads the extension
                return importlib.util.spec_from_file_location(fullname, source)
        return None  # no source: let the rest of the import system say what it finds


def install(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """``SourceFirst`` first on ``sys.meta_path``, once a process: for every listed module, but in an exporter
    process allowed to run compiled, where only for those whose source changed after they were built. True
    where this process imports the sources."""
    env = os.environ if environ is None else environ
    for finder in sys.meta_path:
        if isinstance(finder, SourceFirst):
            return not finder.stale_only
    compiled = env.get(EXPORTER_VARIABLE) == "1" and not pure_python_forced(env)
    sys.meta_path.insert(0, SourceFirst(stale_only=compiled))
    return not compiled


def compiled_in_use() -> tuple[str, ...]:
    """The listed modules this process loaded as extension modules."""
    return tuple(
        name
        for name in COMPILED_MODULES
        if (module := sys.modules.get(name)) is not None
        and isinstance(getattr(module, "__spec__", None), importlib.machinery.ModuleSpec)
        and isinstance(module.__spec__.loader, importlib.machinery.ExtensionFileLoader)  # type: ignore[union-attr]
    )


def compiled_available(*, current: bool = True) -> tuple[str, ...]:
    """The listed modules with an extension module built beside their source (``hatch_build.py``); with
    ``current``, only those built since their source last changed (what an exporter process loads)."""
    out = []
    for name in COMPILED_MODULES:
        spec = importlib.util.find_spec(name.rpartition(".")[0])
        for directory in (spec.submodule_search_locations or ()) if spec is not None else ():
            source = os.path.join(directory, name.rpartition(".")[2] + ".py")
            built = _extension_beside(source)
            if built is not None and (not current or not os.path.isfile(source) or _built_since(built, source)):
                out.append(name)
                break
    return tuple(out)


def status() -> str:
    """One line: how the exporter runs on this install (``scripts/setup.sh`` prints it)."""
    built, current = compiled_available(current=False), compiled_available()
    if not built:
        return "stagetrace: the exporter runs as pure Python (no compiled modules: no C compiler at install?)"
    forced = " (STAGETRACE_PURE_PYTHON=1: not used)" if pure_python_forced() else ""
    if len(current) == len(COMPILED_MODULES):
        return f"stagetrace: the exporter runs {len(current)} of {len(COMPILED_MODULES)} modules compiled{forced}"
    stale = len(built) - len(current)
    why = f"{stale} built before their source changed" if stale else f"{len(COMPILED_MODULES) - len(built)} not built"
    return (
        f"stagetrace: the exporter runs 0 of {len(COMPILED_MODULES)} modules compiled{forced}: {why}, so all run from"
        " source (compiled ones call each other in C; pip install -e . again)"
    )
