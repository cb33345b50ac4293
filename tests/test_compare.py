"""``stagetrace report --compare``: two sets of traces drawn from one distribution have no change called
significant; a known shift is found where it is and nowhere else; files, directories and a fleet's table
(two windows, two group values), in text, JSON and HTML."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest

from otlp_lines import kv, line, span
from stagetrace import conventions as c
from stagetrace.cli.main import main
from stagetrace.cli.report import parse_window, run_compare
from stagetrace.report.compare import Figure, Side, TraceFacts, bootstrap, compare, weighted_quantile

STAGES = ("decode", "tokenize", "infer", "post")


def draw(rng: random.Random, n: int, *, tokenize_scale: float = 1.0, gil_rate: float = 0.2) -> Side:
    """Requests whose stages are lognormal, ``tokenize`` scaled, GIL_CONTENTION on a share of them."""
    side = Side()
    for _ in range(n):
        stages = {name: rng.lognormvariate(1.0, 0.4) for name in STAGES}
        stages["tokenize"] *= tokenize_scale
        codes = ("GIL_CONTENTION",) if rng.random() < gil_rate else ()
        side.add(TraceFacts(sum(stages.values()) + 1.0, stages, max(stages, key=stages.__getitem__), codes))
    return side


@pytest.mark.parametrize("vectorised", [True, False], ids=["numpy", "python"])
def test_two_sets_from_one_distribution_have_no_significant_change(vectorised):
    rng = random.Random(11)
    result = compare(draw(rng, 300), draw(rng, 300), resamples=400 if vectorised else 150, vectorised=vectorised)
    changes = list(result.all_changes())
    assert len(changes) >= 3 + 3 * len(STAGES) + 1
    assert [ch.figure for ch in changes if ch.significant] == []
    assert all(ch.low is not None and ch.low <= ch.change <= ch.high for ch in changes)  # an interval around each


@pytest.mark.parametrize("vectorised", [True, False], ids=["numpy", "python"])
def test_a_known_shift_is_found_where_it_is(vectorised):
    rng = random.Random(5)
    before = draw(rng, 300)
    after = draw(rng, 300, tokenize_scale=2.5, gil_rate=0.0)  # tokenizing moved to a pool, no GIL waits
    result = compare(before, after, resamples=400 if vectorised else 150, vectorised=vectorised)
    shifted = {name for name, changes in result.stages.items() if any(ch.significant for ch in changes)}
    assert shifted == {"tokenize"}
    assert all(ch.significant and ch.change > 0 for ch in result.stages["tokenize"])
    assert result.stages["tokenize"][0].relative == pytest.approx(1.5, rel=0.35)  # p50 about 2.5 times
    (gil,) = result.diagnoses
    assert gil.significant and gil.after == 0.0 and gil.change == pytest.approx(-gil.before)
    tokenize_bottleneck = next(ch for ch in result.bottlenecks if ch.figure == "tokenize")
    assert tokenize_bottleneck.significant and tokenize_bottleneck.change > 0.3
    assert result.latency[0].significant and result.latency[0].change > 0  # the request is longer too


def test_weighted_quantiles_read_each_value_as_often_as_its_weight():
    assert weighted_quantile([], 0.5) is None
    assert weighted_quantile([(3.0, 1.0)], 0.99) == 3.0
    values = [(1.0, 1.0), (2.0, 1.0), (3.0, 1.0), (4.0, 1.0)]
    assert [weighted_quantile(values, q) for q in (0.0, 0.25, 0.26, 0.5, 0.75, 1.0)] == [1.0, 1.0, 2.0, 2.0, 3.0, 4.0]
    assert weighted_quantile([(1.0, 9.0), (100.0, 1.0)], 0.9) == 1.0  # nine tenths of the weight at 1
    assert weighted_quantile([(1.0, 9.0), (100.0, 1.0)], 0.91) == 100.0
    assert weighted_quantile([(5.0, 1.0), (1.0, 1.0)], 0.5) == 1.0  # unsorted input


def test_a_figure_one_side_lacks_has_no_interval_and_is_not_significant():
    before = Side()
    after = Side()
    for i in range(40):
        before.add(TraceFacts(10.0 + i, {"a": 5.0 + i}, "a", ()))
        after.add(TraceFacts(10.0 + i, {"b": 5.0 + i}, "b", ()))
    result = compare(before, after, resamples=100)
    (a_p50, *_), (b_p50, *_) = result.stages["a"], result.stages["b"]
    assert (a_p50.before, a_p50.after, a_p50.low, a_p50.significant) == (24.0, None, None, False)
    assert (b_p50.before, b_p50.after, b_p50.change) == (None, 24.0, None)
    assert {ch.figure: (ch.before, ch.after) for ch in result.bottlenecks} == {"a": (1.0, 0.0), "b": (0.0, 1.0)}


def test_weights_carry_into_the_comparison():
    """Nine healthy traces kept as one (adjusted count 9) beside one slow: the share is 90 % healthy."""
    before, after = Side(), Side()
    for _ in range(30):
        before.add(TraceFacts(1.0, {"x": 1.0}, "x", (), weight=9.0))
        before.add(TraceFacts(100.0, {"x": 100.0}, "x", ("SLOW_THING",), weight=1.0))
        after.add(TraceFacts(1.0, {"x": 1.0}, "x", (), weight=1.0))
        after.add(TraceFacts(100.0, {"x": 100.0}, "x", ("SLOW_THING",), weight=1.0))
    result = compare(before, after, resamples=200)
    (code,) = result.diagnoses
    assert (code.before, code.after) == (pytest.approx(0.1), 0.5) and code.significant
    assert result.latency[0].before == 1.0 and result.latency[0].after == 1.0  # p50: the healthy half


def test_a_side_keeps_a_uniform_sample_and_counts_what_it_read():
    side = Side(max_traces=10)
    for i in range(1000):
        side.add(TraceFacts(float(i), {}, None, ()))
    assert side.seen == 1000 and len(side.traces) == 10
    assert max(t.total_ms for t in side.traces) > 100  # not the first ten only


def test_the_bootstrap_of_an_empty_side_gives_no_interval():
    figure = Figure("latency p50", lambda t: t.total_ms, 0.5)
    (ch,) = bootstrap([figure], [], [TraceFacts(1.0, {}, None, ())], resamples=10)
    assert (ch.before, ch.after, ch.change, ch.low, ch.significant) == (None, 1.0, None, None, False)


# --- from files and from a fleet's table --------------------------------------------------------------------


def write_side(directory: Path, rng: random.Random, n: int, scale: float, version: str, start_s: float) -> list[str]:
    """``n`` requests with stored verdicts (tokenize scaled by ``scale``) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        stages = {"tokenize": rng.lognormvariate(1.0, 0.3) * scale, "infer": rng.lognormvariate(1.5, 0.3)}
        total = sum(stages.values()) + 0.5
        bottleneck = max(stages, key=stages.__getitem__)
        attrs = {
            c.TOTAL_MS: total, c.SLOW: False, c.STAGES: list(stages), c.STAGES_MS: list(stages.values()),
            c.BOTTLENECK_STAGE: bottleneck, c.BOTTLENECK_RATIO: stages[bottleneck] / total, c.HTTP_ROUTE: "/t",
        }  # fmt: skip
        trace = f"{rng.getrandbits(128):032x}"
        start_ms = (start_s + i * 0.01) * 1000
        root = span(trace, "a" * 16, "", "POST /t", start_ms, start_ms + total, attrs, kind=2)
        doc = json.loads(line("svc", [root]))
        doc["resourceSpans"][0]["resource"]["attributes"].append(kv("service.version", version))
        lines.append(json.dumps(doc))
    (directory / "traces-svc-1.jsonl").write_text("\n".join(lines) + "\n")
    return lines


def test_compare_two_directories_in_text_json_and_html(tmp_path, capsys):
    rng = random.Random(3)
    write_side(tmp_path / "before", rng, 120, 3.0, "1.0", 0)
    write_side(tmp_path / "after", rng, 120, 1.0, "1.1", 100)
    out = io.StringIO()
    html = tmp_path / "compare.html"
    assert run_compare(str(tmp_path / "before"), str(tmp_path / "after"), resamples=300, out=out,
                       html_path=str(html)) == 0  # fmt: skip
    text = out.getvalue()
    assert text.startswith(f"stagetrace report --compare: {tmp_path / 'before'} (120 traces) against ")
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("tokenize p50"))
    assert row.rstrip().endswith("significant") and "(-" in row  # a drop, as a share of before
    infer = next(ln for ln in text.splitlines() if ln.strip().startswith("infer p50"))
    assert infer.rstrip().endswith("within noise")
    page = html.read_text()
    assert 'id="compare-stages"' in page and "significant" in page
    capsys.readouterr()
    assert main(["report", "--compare", str(tmp_path / "before"), str(tmp_path / "after"), "--json",
                 "--resamples", "200"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    tokenize = doc["stages"]["tokenize"]["p50"]
    assert tokenize["significant"] and tokenize["change"] < 0 and len(tokenize["interval_95"]) == 2
    assert doc["before"]["traces"] == doc["after"]["traces"] == 120


def test_bad_input_to_compare_is_a_clear_error(tmp_path, capsys):
    err = io.StringIO()
    assert run_compare(str(tmp_path / "nowhere"), str(tmp_path), out=io.StringIO(), err=err) == 2
    assert "no such file or directory" in err.getvalue()
    (tmp_path / "empty").mkdir()
    err = io.StringIO()
    assert run_compare(str(tmp_path / "empty"), str(tmp_path / "empty"), out=io.StringIO(), err=err) == 2
    assert "no trace files" in err.getvalue()
    with pytest.raises(SystemExit):
        main(["report", "x", "--compare", "a", "b"])
    assert "no other paths" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"SINCE\.\.UNTIL"):
        parse_window("yesterday")
    assert parse_window("..1700000000")[0] is None


@pytest.mark.chdb
def test_compare_in_a_fleets_table_by_windows_and_by_group(tmp_path):
    pytest.importorskip("chdb.session")
    from stagetrace.cli.report import run_clickhouse_compare
    from test_report_clickhouse import SOURCE, load

    rng = random.Random(8)
    lines = write_side(tmp_path / "before", rng, 100, 3.0, "1.0", 1_000)
    lines += write_side(tmp_path / "after", rng, 100, 1.0, "1.1", 2_000)
    db = tmp_path / "db"
    load(db, lines)
    base_s = 1_700_000_000  # otlp_lines' epoch
    windows = (f"{base_s + 900}..{base_s + 1_500}", f"{base_s + 1_900}..{base_s + 2_500}")
    for sides, group_by in ((windows, None), (("1.0", "1.1"), "service.version")):
        out, err = io.StringIO(), io.StringIO()
        rc = run_clickhouse_compare(f"chdb:{db}", *sides, database=SOURCE.database, group_by=group_by,
                                    resamples=200, as_json=True, out=out, err=err)  # fmt: skip
        assert rc == 0, err.getvalue()
        doc = json.loads(out.getvalue())
        assert doc["before"]["traces"] == doc["after"]["traces"] == 100
        assert doc["stages"]["tokenize"]["p50"]["significant"] and doc["stages"]["tokenize"]["p50"]["change"] < 0
        assert not doc["stages"]["infer"]["p50"]["significant"]
    err = io.StringIO()
    assert run_clickhouse_compare(f"chdb:{db}", "..", f"{base_s}..{base_s + 1}", database=SOURCE.database,
                                  out=io.StringIO(), err=err) == 2  # fmt: skip
    assert "no traces to compare" in err.getvalue()
