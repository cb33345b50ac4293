"""The documentation site builds with ``mkdocs build --strict``, and its reference names everything the code
names: every ``STAGETRACE_*`` variable the package reads, every span attribute and metric attribute
``conventions.py`` defines, every metric in ``INSTRUMENTS`` and every ``stagetrace.dropped`` reason a
``dropped(...)`` / ``on_drop(...)`` call counts. The code's sets are read from the code here, apart from the
docs hook that renders the tables, so that a hook that lost a row cannot pass its own test."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from stagetrace import conventions
from stagetrace.exporter.metrics import INSTRUMENTS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "stagetrace"
BUILD_TIMEOUT_S = 120  # a build takes 5-15 s on this project's 2-vCPU machines

pytestmark = pytest.mark.skipif(
    shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
    reason="mkdocs is not installed (pip install -e '.[docs]')",
)


# --- what the code names, read from the code ----------------------------------------------------------------
def package_sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def env_variables() -> set[str]:
    names: set[str] = set()
    for path in package_sources():
        names.update(re.findall(r"\bSTAGETRACE_[A-Z][A-Z0-9_]*\b", path.read_text(encoding="utf-8")))
    return names


def convention_names() -> set[str]:
    """conventions.py's upper-case string constants, and every attribute-like literal in its source (the
    field tables name some attributes inline)."""
    names = {v for k, v in vars(conventions).items() if k.isupper() and isinstance(v, str)}
    source = Path(conventions.__file__).read_text(encoding="utf-8")
    names.update(re.findall(r"\"((?:stagetrace|gen_ai)\.[a-z0-9_.]+)\"", source))
    return names


def metric_names() -> set[str]:
    return {instrument.name for instrument in INSTRUMENTS}


def drop_reasons() -> set[str]:
    """The string literals in the first argument of every ``dropped(...)``, ``_dropped(...)``,
    ``on_drop(...)`` and ``_on_drop(...)`` call in the package."""
    reasons: set[str] = set()
    for path in package_sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("dropped", "_dropped", "on_drop", "_on_drop"):
                reasons.update(
                    n.value for n in ast.walk(node.args[0]) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                )
    return reasons


# --- what the built reference says --------------------------------------------------------------------------
class CodeSpans(HTMLParser):
    """The text of every ``<code>`` element of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: set[str] = set()
        self._depth = 0
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "code":
            self._depth += 1
            self._text = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "code" and self._depth:
            self._depth -= 1
            self.spans.add("".join(self._text).strip())

    def handle_data(self, data: str) -> None:
        if self._depth:
            self._text.append(data)


def code_spans(site: Path, page: str) -> set[str]:
    parser = CodeSpans()
    parser.feed((site / page / "index.html").read_text(encoding="utf-8"))
    return parser.spans


def missing_from_reference(site: Path) -> dict[str, list[str]]:
    """Per kind of name, those the code has and the built reference does not show (as code)."""
    attributes = code_spans(site, "reference/attributes")
    metrics = code_spans(site, "reference/metrics")
    configuration = code_spans(site, "reference/configuration")
    wanted = {
        "STAGETRACE_* variables (reference/configuration)": (env_variables(), configuration),
        "conventions.py names (reference/attributes, reference/metrics)": (convention_names(), attributes | metrics),
        "metrics (reference/metrics)": (metric_names(), metrics),
        "stagetrace.dropped reasons (reference/metrics)": (drop_reasons(), metrics),
    }
    return {kind: sorted(names - shown) for kind, (names, shown) in wanted.items() if names - shown}


# --- the tests ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.mark.slow
def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    for page in ("index.html", "reference/api/index.html", "rules/index.html", "architecture/index.html"):
        assert (site / page).is_file(), page
    api = (site / "reference/api/index.html").read_text(encoding="utf-8")
    for name in ("configure", "stage", "pipeline", "batch", "enqueue", "gpu_stage", "Settings", "Verdict"):
        assert re.search(rf'<h2 id="stagetrace\.[a-z_.]*\b{name}"', api), name


@pytest.mark.slow
def test_the_reference_names_everything_the_code_names(site: Path) -> None:
    # The code's sets are not empty: a broken reader would pass anything.
    assert {"STAGETRACE_EXPORT_BUDGET", "STAGETRACE_RECORD_QUERY_STRINGS"} <= env_variables()
    assert {"stagetrace.stage", "stagetrace.stream.duration_ms"} <= convention_names()
    assert {"stagetrace.stage.duration", "stagetrace.dropped"} <= metric_names()
    assert {"budget", "gpu_parked_full", "batch_not_a_ticket", "unpackable"} <= drop_reasons()
    missing = missing_from_reference(site)
    assert not missing, f"in the code, not in the built reference: {missing}"


@pytest.mark.slow
def test_a_name_missing_from_the_reference_is_found(site: Path, tmp_path: Path) -> None:
    """The check itself: take one drop reason and one variable out of a copy of the built site."""
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    for page, name in (("reference/metrics", "gpu_parked_full"), ("reference/configuration", "STAGETRACE_DISABLED")):
        html = copy / page / "index.html"
        text = html.read_text(encoding="utf-8")
        assert f"<code>{name}</code>" in text
        html.write_text(text.replace(f"<code>{name}</code>", "<code>-</code>"), encoding="utf-8")
    missing = missing_from_reference(copy)
    assert missing["stagetrace.dropped reasons (reference/metrics)"] == ["gpu_parked_full"]
    assert missing["STAGETRACE_* variables (reference/configuration)"] == ["STAGETRACE_DISABLED"]
