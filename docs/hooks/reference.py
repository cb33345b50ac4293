"""MkDocs hook: the reference tables, rendered when the site is built from the code's own tables, so that the
docs cannot drift from the code.

A page asks for a table with an HTML comment on a line of its own, ``<!-- stagetrace:NAME [ARGUMENT] -->``
(invisible where the Markdown is read as it is, on GitHub). The sources:

- span attributes, metric attribute keys, metrics' attributes and the drop reasons' meanings:
  ``stagetrace.conventions`` (``ATTRIBUTE_REFERENCE``, ``METRIC_ATTRIBUTES``, ``METRIC_ATTRIBUTE_REFERENCE``,
  ``DROP_REASONS``) and its field tables (``STAGE_SIGNALS``, ``VERDICT_FIELDS``, ``STREAM_FIELDS``);
- metrics' names, kinds, units, descriptions and buckets: ``stagetrace.exporter.metrics.INSTRUMENTS``;
- the drop reasons themselves: every ``dropped("...")`` / ``on_drop("...")`` call in the package's source;
- ``STAGETRACE_*`` variables: ``stagetrace.settings.ENVIRONMENT_REFERENCE``, checked against every variable
  the package's source names; ``Settings`` fields with their defaults and ``SETTINGS_REFERENCE``; the fixed
  bounds, module constants of ``settings.py`` with their comments;
- the diagnosis rules: ``stagetrace.analysis.diagnosis.RULES`` (code, advice, the signals each needs, the
  thresholds each reads) and ``DiagnosisThresholds`` (defaults, and the comments beside the fields);
- the API reference: mkdocstrings directives for every name in ``stagetrace.__all__``.

Whatever the code names and the reference does not describe (or the other way round) stops the build with a
message saying what to add where. ``python docs/hooks/reference.py`` runs the same checks without MkDocs.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import os
import posixpath
import re
import tokenize
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "stagetrace"
PLACEHOLDER = re.compile(
    r"^<!--\s*stagetrace:(?P<name>[a-z-]+)(?:[ \t]+(?P<arg>[A-Za-z0-9_.-]+))?[ \t]*-->[ \t]*$", re.MULTILINE
)
ENV_VARIABLE = re.compile(r"\bSTAGETRACE_[A-Z][A-Z0-9_]*\b")
DROP_CALLS = frozenset({"dropped", "_dropped", "on_drop", "_on_drop"})
PLACES = {"stage": "stage spans", "batch": "a batch's own span", "root": "the local root", "event": "the event"}
PYTHON_TYPES = {float: "double", int: "int", bool: "boolean", str: "string", tuple: "string[]"}
RULES_DIR = "rules"
_page = {"uri": "index.md"}  # the page being rendered: links are written relative to it


class ReferenceMismatch(Exception):
    """What the reference lacks, or what it describes that the code no longer has."""


# --- what the code names ------------------------------------------------------------------------------------
def conventions() -> Any:
    from stagetrace import conventions as c

    return c


def source_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def env_variables_in_source() -> dict[str, list[str]]:
    """Every ``STAGETRACE_*`` name the package's source mentions, with the modules that do."""
    found: dict[str, list[str]] = {}
    for path in source_files():
        for name in sorted(set(ENV_VARIABLE.findall(path.read_text(encoding="utf-8")))):
            found.setdefault(name, []).append(path.relative_to(PACKAGE).as_posix())
    return found


def drop_reasons_in_source() -> dict[str, list[str]]:
    """Every reason a ``dropped(...)`` or ``on_drop(...)`` call counts, from the string literals of its first
    argument (``"a" if x else "b"`` gives both), with the modules that count it."""
    found: dict[str, list[str]] = {}
    for path in source_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in DROP_CALLS:
                continue
            for literal in ast.walk(node.args[0]):
                if isinstance(literal, ast.Constant) and isinstance(literal.value, str):
                    module = path.relative_to(PACKAGE).as_posix()
                    modules = found.setdefault(literal.value, [])
                    if module not in modules:
                        modules.append(module)
    return found


def convention_names() -> set[str]:
    """Every name ``conventions.py`` defines: its string constants and the attributes of its field tables."""
    c = conventions()
    names = {v for k, v in vars(c).items() if isinstance(v, str) and k.isupper()}
    for table in (c.STAGE_SIGNALS, c.VERDICT_FIELDS, c.STREAM_FIELDS):
        names.update(row[1] for row in table)
    return names


def instruments() -> tuple[Any, ...]:
    from stagetrace.exporter.metrics import INSTRUMENTS

    return tuple(INSTRUMENTS)


def rules() -> tuple[Any, ...]:
    from stagetrace.analysis.diagnosis import RULES

    return tuple(RULES)


def thresholds_class() -> type:
    from stagetrace.analysis import DiagnosisThresholds

    return DiagnosisThresholds


def rule_page(code: str) -> str:
    return f"{RULES_DIR}/{code.lower().replace('_', '-')}.md"


def link(target: str) -> str:
    """``target`` (a path under docs/) relative to the page being rendered."""
    return posixpath.relpath(target, posixpath.dirname(_page["uri"]) or ".")


def rule_link(code_: str) -> str:
    return f"[`{code_}`]({link(rule_page(code_))})"


# --- checks: the code and the reference agree ---------------------------------------------------------------
def check() -> None:
    c = conventions()
    problems: list[str] = []
    described = {row[0] for row in c.ATTRIBUTE_REFERENCE}
    described |= {name for name, _ in c.METRIC_ATTRIBUTE_REFERENCE}
    described |= {i.name for i in instruments()}
    described |= set(reserved_names())
    missing = sorted(convention_names() - described)
    if missing:
        problems.append(f"conventions.py names without a row in ATTRIBUTE_REFERENCE (or a metric's): {missing}")
    declared: dict[str, str] = {}
    for table in (c.STAGE_SIGNALS, c.VERDICT_FIELDS, c.STREAM_FIELDS):
        for row in table:
            declared[row[1]] = PYTHON_TYPES[row[2]]
    for name, kind, places, _ in c.ATTRIBUTE_REFERENCE:
        if name in declared and declared[name] != kind and "root" in places:
            problems.append(f"ATTRIBUTE_REFERENCE says {name} is {kind}; its field table says {declared[name]}")
        if not set(places) <= set(PLACES):
            problems.append(f"ATTRIBUTE_REFERENCE: {name}'s places {places} not among {sorted(PLACES)}")
    metric_names = [i.name for i in instruments()]
    if set(metric_names) != set(c.METRIC_ATTRIBUTES):
        problems.append(
            f"METRIC_ATTRIBUTES and INSTRUMENTS disagree: {sorted(set(metric_names) ^ set(c.METRIC_ATTRIBUTES))}"
        )
    reasons = drop_reasons_in_source()
    if set(reasons) != set(c.DROP_REASONS):
        undescribed, uncounted = sorted(set(reasons) - set(c.DROP_REASONS)), sorted(set(c.DROP_REASONS) - set(reasons))
        problems.append(
            f"drop reasons counted in the code but not in conventions.DROP_REASONS: {undescribed}; "
            f"described but counted nowhere: {uncounted}"
        )
    from stagetrace import settings as s

    variables = env_variables_in_source()
    listed = [row[0] for row in s.ENVIRONMENT_REFERENCE]
    if set(variables) != set(listed):
        unlisted, unread = sorted(set(variables) - set(listed)), sorted(set(listed) - set(variables))
        problems.append(
            f"STAGETRACE_* variables read but not in settings.ENVIRONMENT_REFERENCE: {unlisted}; "
            f"listed but read nowhere: {unread}"
        )
    fields = {f.name for f in dataclasses.fields(s.Settings)}
    if fields != set(s.SETTINGS_REFERENCE):
        disagree = sorted(fields ^ set(s.SETTINGS_REFERENCE))
        problems.append(f"Settings fields and settings.SETTINGS_REFERENCE disagree: {disagree}")
    threshold_fields = {f.name for f in dataclasses.fields(thresholds_class())}
    for rule in rules():
        unknown = set(getattr(rule, "thresholds", ())) - threshold_fields
        if unknown:
            problems.append(f"rule {rule.code} reads thresholds that DiagnosisThresholds lacks: {sorted(unknown)}")
    if problems:
        raise ReferenceMismatch("the reference and the code disagree:\n- " + "\n- ".join(problems))


# --- rendering ----------------------------------------------------------------------------------------------
def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def code(text: object) -> str:
    return f"`{text}`"


def table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def render_attributes(place: str | None) -> str:
    if place not in PLACES:
        raise ReferenceMismatch(f"stagetrace:attributes needs one of {sorted(PLACES)}, got {place!r}")
    rows = [(code(n), t, m) for n, t, places, m in conventions().ATTRIBUTE_REFERENCE if place in places]
    return table(("attribute", "type", "meaning"), rows)


def prometheus_name(instrument: Any) -> str:
    """The name Prometheus gives the metric (dots to underscores, the unit and ``_total`` suffixes)."""
    base = instrument.name.replace(".", "_")
    unit = {"ms": "_milliseconds", "s": "_seconds", "1": "(_ratio)"}.get(instrument.unit, "")
    if instrument.kind == "counter":
        return f"{base}{unit}_total"
    if instrument.kind == "histogram":
        return f"{base}{unit}_*"
    return f"{base}{unit}"


def render_metrics(_: str | None) -> str:
    c = conventions()
    rows = [
        (code(i.name), i.kind, code(i.unit), ", ".join(code(a) for a in c.METRIC_ATTRIBUTES[i.name]), i.description)
        for i in instruments()
    ]
    return table(("instrument", "kind", "unit", "attributes", "description"), rows)


def render_prometheus(_: str | None) -> str:
    return table(("instrument", "in Prometheus"), [(code(i.name), code(prometheus_name(i))) for i in instruments()])


def render_buckets(_: str | None) -> str:
    rows = [(code(i.name), ", ".join(f"{b:g}" for b in i.buckets)) for i in instruments() if i.buckets]
    return table(("histogram", "bucket boundaries"), rows)


def render_metric_attributes(_: str | None) -> str:
    return table(("attribute", "meaning"), [(code(n), m) for n, m in conventions().METRIC_ATTRIBUTE_REFERENCE])


def render_drop_reasons(_: str | None) -> str:
    found = drop_reasons_in_source()
    described = conventions().DROP_REASONS
    rows = [(code(r), described[r], ", ".join(code(m) for m in found[r])) for r in described]
    return table(("reason", "what was dropped", "counted in"), rows)


def reserved_names() -> dict[str, str]:
    c = conventions()
    return {
        c.UNTRACKED: "the bottleneck's name for time in no stage, when it exceeds every stage; no stage may take it",
        c.EVENT_LOOP_WAIT: "the `wait` stage stagetrace adds for time a request was ready while other requests' "
        "sync stages held its event loop; no stage may take it",
        c.CLIENT_DISCONNECTED: "the value of `error.type` on a stream whose client went away",
        c.INSTRUMENTATION_NAME: "the instrumentation scope of stagetrace's spans and metrics",
        c.DIAGNOSIS_EVENT: "the name of the event each diagnosis adds to the local root",
        c.SLOW_TOTAL: "`stagetrace.slow.reason` of a response slow by its duration",
        c.SLOW_FIRST_CHUNK: "`stagetrace.slow.reason` of a stream slow by its time to the first chunk",
        c.SLOW_GAP: "`stagetrace.slow.reason` of a stream slow by its gaps' p99",
        c.OFFLOAD_QUEUE_STAGE: "an offload stage's child (`wait`): the call's wait for a worker of its pool",
        c.OFFLOAD_SEND_STAGE: "an offload stage's child (`io`): the arguments' serialisation and way to the worker",
        c.OFFLOAD_RUN_STAGE: "an offload stage's child (`cpu`): the worker's run, its own stages under it",
        c.OFFLOAD_RETURN_STAGE: "an offload stage's child (`io`): the result's way back and its reading",
    }


def render_reserved(_: str | None) -> str:
    c = conventions()
    rows = [(code(n), m) for n, m in reserved_names().items()]
    rows.append((", ".join(code(k) for k in c.STAGE_KINDS), "the stage kinds, in pipeline order"))
    rows += [
        (code(span), f"{scope}'s span, read as a stage of kind `{kind}`")
        for (scope, span), kind in c.FOREIGN_STAGES.items()
    ]
    return table(("name", "meaning"), rows)


def render_environment(_: str | None) -> str:
    from stagetrace.settings import ENVIRONMENT_REFERENCE

    found = env_variables_in_source()
    rows = [
        (code(v), values, effect, ", ".join(code(m) for m in found.get(v, ())))
        for v, values, effect in ENVIRONMENT_REFERENCE
    ]
    return table(("variable", "values", "effect", "read in"), rows)


def clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("STAGETRACE_", "OTEL_"))}


def field_default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return code(repr(f.default))
    factory: Callable[[], Any] = f.default_factory  # type: ignore[assignment]
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(clean_environment())
        value = factory()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if dataclasses.is_dataclass(value):
        return code(f"{type(value).__name__}()")
    return code(repr(value))


def render_settings(_: str | None) -> str:
    from stagetrace.settings import SETTINGS_REFERENCE, Settings

    rows = [(code(f.name), field_default(f), SETTINGS_REFERENCE[f.name]) for f in dataclasses.fields(Settings)]
    return table(("field", "default", "meaning"), rows)


def source_comments(path: Path) -> tuple[dict[int, str], dict[int, str]]:
    """The comments of a source file: those ending a line of code, and those on lines of their own (by line)."""
    trailing: dict[int, str] = {}
    alone: dict[int, str] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    with io.StringIO("\n".join(lines) + "\n") as stream:
        for tok in tokenize.generate_tokens(stream.readline):
            if tok.type == tokenize.COMMENT:
                line = tok.start[0]
                text = tok.string.lstrip("#").strip()
                if lines[line - 1].lstrip().startswith("#"):
                    alone[line] = text
                else:
                    trailing[line] = text
    return trailing, alone


def block_above(alone: dict[int, str], line: int) -> str:
    out: list[str] = []
    at = line - 1
    while at in alone:
        out.insert(0, alone[at])
        at -= 1
    return " ".join(out)


def described_assignments(path: Path, body: list[ast.stmt], names_in_block: bool) -> list[tuple[str, str, str]]:
    """(name, value as written, comment) for each annotated or plain assignment of ``body``. A field takes its
    own trailing comment, else the comment block above it; with ``names_in_block`` a block also describes the
    fields below it that it names."""
    trailing, alone = source_comments(path)
    text = path.read_text(encoding="utf-8")
    out: list[tuple[str, str, str]] = []
    block = ""
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        else:
            block = ""
            continue
        above = block_above(alone, node.lineno)
        if above:
            block = above
        comment = trailing.get(node.lineno) or above
        if not comment and names_in_block and re.search(rf"\b{re.escape(name)}\b", block):
            comment = block
        written = ast.get_source_segment(text, value) if value is not None else ""
        out.append((name, written or "", comment))
    return out


def render_bounds(_: str | None) -> str:
    from stagetrace import settings

    path = Path(inspect.getsourcefile(settings) or "")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    rows = [
        (code(name), code(value), comment or "—")
        for name, value, comment in described_assignments(path, tree.body, names_in_block=False)
        if name.isupper() and isinstance(getattr(settings, name, None), (int, float, str))
    ]
    return table(("constant", "value", "meaning"), rows)


def threshold_rows(only: Iterable[str] | None = None) -> list[tuple[str, str, str, str]]:
    cls = thresholds_class()
    path = Path(inspect.getsourcefile(cls) or "")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    comments = {name: comment for name, _, comment in described_assignments(path, body, names_in_block=True)}
    readers: dict[str, list[str]] = {}
    for rule in rules():
        for field in getattr(rule, "thresholds", ()):
            readers.setdefault(field, []).append(rule.code)
    wanted = list(only) if only is not None else [f.name for f in dataclasses.fields(cls)]
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    return [
        (
            code(name),
            code(repr(defaults[name])),
            ", ".join(rule_link(r) for r in readers.get(name, ())),
            comments.get(name) or "—",
        )
        for name in wanted
    ]


def render_thresholds(_: str | None) -> str:
    return table(("field", "default", "read by", "note beside the field"), threshold_rows())


def find_rule(code_: str | None) -> Any:
    for rule in rules():
        if rule.code == code_:
            return rule
    raise ReferenceMismatch(f"no diagnosis rule {code_!r} (RULES has {[r.code for r in rules()]})")


def render_rule(code_: str | None) -> str:
    rule = find_rule(code_)
    order = [r.code for r in rules()].index(rule.code) + 1
    requires = sorted(getattr(s, "value", str(s)) for s in getattr(rule, "requires", ()))
    parts = [
        f"**Code** `{rule.code}` (rule {order} of {len(rules())}, in the order `diagnose` runs them). "
        + (f"**Needs**: {'; '.join(requires)}." if requires else "**Needs** no signal beyond the trace's stages."),
        "",
        "**Advice** (the diagnosis event's `stagetrace.diagnosis.advice`):",
        "",
        "> " + rule.advice,
    ]
    between = getattr(rule, "undetermined_between", ())
    if between:
        parts += [
            "",
            "It names no cause: it is what the verdict says when it cannot tell "
            + ", ".join(rule_link(b) for b in between)
            + " apart.",
        ]
    fields = getattr(rule, "thresholds", ())
    parts += ["", "**Thresholds it reads** (fields of `DiagnosisThresholds`, with their defaults):", ""]
    if fields:
        rows = [(field, default, note) for field, default, _, note in threshold_rows(fields)]
        parts.append(table(("field", "default", "note beside the field"), rows))
    else:
        parts.append("None.")
    return "\n".join(parts)


def render_rules(_: str | None) -> str:
    rows = []
    for n, rule in enumerate(rules(), 1):
        needs = ", ".join(sorted(getattr(s, "name", str(s)).lower() for s in getattr(rule, "requires", ()))) or "—"
        rows.append((n, rule_link(rule.code), needs, rule.advice.split(". ")[0].rstrip(".") + "."))
    return table(("#", "code", "needs", "advice, first sentence"), rows)


def render_api(_: str | None) -> str:
    import stagetrace

    out = []
    for name in sorted(stagetrace.__all__, key=lambda n: (not n[0].isupper(), n.lower())):
        if name.startswith("__"):
            continue
        obj = getattr(stagetrace, name)
        out += [f"::: {obj.__module__}.{obj.__qualname__}", ""]
    return "\n".join(out)


RENDERERS: dict[str, Callable[[str | None], str]] = {
    "attributes": render_attributes,
    "metrics": render_metrics,
    "prometheus": render_prometheus,
    "buckets": render_buckets,
    "metric-attributes": render_metric_attributes,
    "drop-reasons": render_drop_reasons,
    "reserved": render_reserved,
    "environment": render_environment,
    "settings": render_settings,
    "bounds": render_bounds,
    "thresholds": render_thresholds,
    "rule": render_rule,
    "rules": render_rules,
    "api": render_api,
}


def render(markdown: str) -> str:
    def one(match: re.Match[str]) -> str:
        renderer = RENDERERS.get(match["name"])
        if renderer is None:
            raise ReferenceMismatch(f"unknown table stagetrace:{match['name']} (known: {sorted(RENDERERS)})")
        return renderer(match["arg"])

    return PLACEHOLDER.sub(one, markdown)


# --- MkDocs events ------------------------------------------------------------------------------------------
def _fail(error: Exception) -> Exception:
    from mkdocs.exceptions import PluginError

    return PluginError(str(error))


def on_config(config: Any) -> Any:
    try:
        check()
    except ReferenceMismatch as e:
        raise _fail(e) from None
    return config


def on_files(files: Any, config: Any) -> Any:
    pages = {f.src_uri for f in files.documentation_pages()}
    wanted = {rule_page(r.code) for r in rules()}
    present = {p for p in pages if p.startswith(RULES_DIR + "/") and p != f"{RULES_DIR}/index.md"}
    if wanted != present:
        raise _fail(
            ReferenceMismatch(
                f"one page per diagnosis rule: missing {sorted(wanted - present)}, "
                f"without a rule {sorted(present - wanted)}"
            )
        )
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    _page["uri"] = page.file.src_uri
    try:
        return render(markdown)
    except (ReferenceMismatch, KeyError) as e:
        raise _fail(ReferenceMismatch(f"{page.file.src_uri}: {e}")) from None


if __name__ == "__main__":
    check()
    print("the reference and the code agree")
