"""Build hook: the exporter's per-trace modules compiled with Cython in pure-Python mode, from the same ``.py``
files (``src/stagetrace/_compiled.py`` lists them), as extension modules beside the sources.

Built in place for an editable install and into the wheel otherwise (then a platform wheel). Where there is
no C compiler, or Cython cannot build them, it says so in one line and the install goes on as pure Python:
the sources are the fallback, and only the exporter process ever loads the compiled modules.
``STAGETRACE_PURE_PYTHON=1`` at install builds nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

ROOT = Path(__file__).parent
SRC = ROOT / "src"


def compiled_modules() -> tuple[str, ...]:
    """The list in ``stagetrace/_compiled.py`` (read without importing stagetrace, which the build lacks)."""
    namespace: dict[str, Any] = {"__name__": "stagetrace_compiled_list"}
    exec(compile((SRC / "stagetrace" / "_compiled.py").read_text(), "_compiled.py", "exec"), namespace)
    return tuple(namespace["COMPILED_MODULES"])


def build_in_place(modules: tuple[str, ...]) -> list[Path]:
    """Each module's extension beside its source; raises where it cannot be built."""
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    extensions = [Extension(name, [str(SRC / (name.replace(".", "/") + ".py"))]) for name in modules]
    with tempfile.TemporaryDirectory(prefix="stagetrace-build-") as scratch:
        compiled = cythonize(
            extensions,
            build_dir=os.path.join(scratch, "c"),  # the generated C stays out of the tree
            # annotations are not C types: a ``float`` parameter must keep an int an int (a counter's points
            # are integers in OTLP), as the sources do
            compiler_directives={"language_level": "3", "annotation_typing": False},
            quiet=True,
        )
        dist = Distribution({"name": "stagetrace", "ext_modules": compiled, "package_dir": {"": str(SRC)}})
        build_ext = dist.get_command_obj("build_ext")
        build_ext.inplace = True
        build_ext.build_temp = os.path.join(scratch, "tmp")
        build_ext.parallel = os.cpu_count() or 1
        build_ext.ensure_finalized()
        build_ext.run()
        return [Path(p) for p in build_ext.get_outputs()]


class CompiledExporterHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if os.environ.get("STAGETRACE_PURE_PYTHON", "").strip().lower() in ("1", "true", "yes", "on"):
            print("stagetrace: STAGETRACE_PURE_PYTHON=1, the exporter's modules not compiled", file=sys.stderr)
            return
        try:
            built = build_in_place(compiled_modules())
        except Exception as e:  # no compiler, no Cython, a build error: the sources are the fallback
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            print(f"stagetrace: the exporter's modules not compiled ({reason}): pure Python", file=sys.stderr)
            return
        if version == "editable":
            return  # in place, beside the sources the editable install points to
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["artifacts"].extend(str(path.relative_to(ROOT)) for path in built)
