"""``common.decimals.round_to`` is ``round(value, digits)``, float for float (sign of zero and type included):
on ties and near-ties, at its limits, on values no arithmetic path takes, on random floats, and in the
compiled build the exporter runs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import compiled_only, run_compiled
from stagetrace.common import decimals
from stagetrace.common.decimals import round_to

# fmt: off
EDGES = [
    0.0, -0.0, 0.0005, 0.0015, 0.0025, -0.0005, -0.0004, 0.0004999999999999999, 1.2345, 2.675, 1.0005,
    0.1 + 0.2, 999.9995, 123456.7895, -123456.7895, 5e-324, 1e-300, 2.0**31 / 1000, 2.0**31 / 1000 - 0.0001,
    2.0**31 / 1000 + 0.0001, 1e12, -1e12, 4.35, 0.125, 0.375, 2.5, 3.5, -2.5, 1e-7, 0.9999995, 1.9999995,
    math.nan, math.inf, -math.inf,
]
# fmt: on


def same(a: object, b: object) -> bool:
    """Equal as ``repr`` tells them (so -0.0 is not 0.0, and NaN is NaN), of the same type."""
    return type(a) is type(b) and repr(a) == repr(b)


@pytest.mark.parametrize("digits", range(7))
def test_round_to_is_round_on_ties_near_ties_limits_and_values_it_hands_back(digits):
    for value in EDGES:
        assert same(round_to(value, digits), round(value, digits)), (value, digits)
    # the ties and their neighbours at this scale: n + 1/2 units of the last digit, a float either side
    for n in (0, 1, 2, 7, 12345, 2**20, -1, -12346):
        tie = (n + 0.5) / 10**digits
        for value in (tie, math.nextafter(tie, math.inf), math.nextafter(tie, -math.inf)):
            assert same(round_to(value, digits), round(value, digits)), (value, digits)


def test_what_is_not_a_float_or_a_served_digit_count_goes_to_round_itself():
    assert same(round_to(5, 3), 5) and same(round_to(True, 2), 1)
    assert same(round_to(2.675, 7), round(2.675, 7)) and same(round_to(1234.5678, -2), 1200.0)


@given(st.floats(allow_nan=False, allow_infinity=False), st.integers(0, 6))
def test_round_to_is_round_on_any_float(value, digits):
    assert same(round_to(value, digits), round(value, digits))


@given(st.floats(-1e7, 1e7), st.integers(0, 6))
def test_round_to_is_round_on_the_figures_the_exporter_rounds(value, digits):
    assert same(round_to(value, digits), round(value, digits))


MARGIN = 2.0**-20  # decimals._TIE_MARGIN, written out: a fraction this far from one half is no tie
LARGEST = 2.0**31  # decimals._LARGEST_SCALED, written out


@pytest.mark.parametrize(
    ("value", "digits", "arithmetic"),
    [
        (12.3456789, 3, True),  # a stage's CPU milliseconds: the figures the path is for
        (0.0123, 2, True),
        (2.7, 0, True),  # no decimals is a served count
        (-2.7, 6, True),
        (2.675, 7, False),  # seven is not
        (LARGEST - 1.0, 0, True),  # the largest products the path takes, either sign
        (-(LARGEST - 1.0), 0, True),
        (LARGEST, 0, False),  # from here on round() itself
        (-LARGEST, 0, False),
        (0.5 + MARGIN, 0, False),  # the margin's upper end goes to round(); its lower end and past either, the path
        (0.5 - MARGIN, 0, True),
        (0.5 + 2 * MARGIN, 0, True),
        (2.5, 0, False),
        (-2.5, 0, False),
    ],
)
def test_which_figures_the_arithmetic_path_answers_and_which_it_leaves_to_round(value, digits, arithmetic):
    """The arithmetic path answers the usual figures (else it saves nothing) and hands round() the rest: its
    limits are where they are documented, so that a wrong limit shows here and not only as a slower exporter."""
    calls = []
    real_round = round

    def counting_round(value, digits=None):
        calls.append(value)
        return real_round(value, digits)

    decimals.round = counting_round  # type: ignore[attr-defined]  # the module's global, read before the builtin
    try:
        assert same(round_to(value, digits), real_round(value, digits))
    finally:
        del decimals.round  # type: ignore[attr-defined]
    assert (calls == []) is arithmetic, calls


def test_three_decimals_unless_told_otherwise():
    """The exporter's figures are milliseconds to the microsecond: three decimals is the default."""
    assert same(round_to(12.3456789), 12.346) and same(round_to(-0.0004), -0.0) and same(round_to(-0.0), -0.0)


def test_the_margins_written_here_are_the_modules():
    """The cases above write the limits out (a test reading them from the module would move with a wrong one):
    this keeps those copies the module's."""
    assert (decimals._TIE_MARGIN, decimals._LARGEST_SCALED) == (MARGIN, LARGEST)


@compiled_only("stagetrace.common.decimals")
def test_the_compiled_module_gives_the_same_floats():
    script = (
        "import math, random, sys\n"
        f"values = {[v for v in EDGES if math.isfinite(v)]!r}\n"
        "rng = random.Random(7)\n"
        "values += [rng.uniform(-1e4, 1e4) for _ in range(20000)] + [rng.random() / 1000 for _ in range(20000)]\n"
        "bad = [(v, d) for v in values for d in range(7) if repr(decimals.round_to(v, d)) != repr(round(v, d))]\n"
        "sys.exit(f'differ: {bad[:5]}' if bad else 0)\n"
    )
    run_compiled("stagetrace.common.decimals", script)
