"""Figures rounded to a few decimals, as ``round(value, digits)`` gives them, at a tenth of its cost.

The exporter rounds some twenty figures a trace (a stage's CPU split, the process's load, the samplers'
means) to the microsecond, and ``round(float, digits)`` converts each to a correctly rounded decimal string
and back: about 3,200 instructions a call, a tenth of the exporter's work on a trace. ``round_to`` gives the
same float by arithmetic wherever arithmetic is exact enough to, and asks ``round`` itself elsewhere.

Why the same float: ``value * 10**digits`` is off the exact product by at most half a unit in its last place,
so its nearest integer ``n`` is the exact product's unless that product lies within the error of a tie
(a fraction of .5), which is left to ``round``; and ``n / 10**digits``, a correctly rounded IEEE division of
two exact values, is the float nearest ``n`` thousandths: the one ``round`` reads back from its string.
Pure; tests/test_decimals.py holds it to ``round`` on edges and random values.
"""

from __future__ import annotations

_SCALES = (1.0, 10.0, 100.0, 1000.0, 10000.0, 100000.0, 1000000.0)  # exact: 10**d for the digits served
# Past this a product's rounding error nears the tie margin below: ``round`` itself (and it takes NaN and
# infinities, which no comparison lets through).
_LARGEST_SCALED = 2.0**31
# A float that a fraction's distance from one half can equal (a power of two), so that both ends of the margin
# are reachable (the upper one goes to round(), the lower one to the arithmetic: either gives round()'s float);
# the products' error stays under 2.4e-7 below _LARGEST_SCALED
_TIE_MARGIN = 2.0**-20


def round_to(value: float, digits: int = 3) -> float:
    """``round(value, digits)`` for ``digits`` 0-6: the same result, of the same type (an int stays an int).

    Compiled, ``decimals.pxd`` makes the locals C doubles and integers: plain arithmetic, no call."""
    if type(value) is not float or not 0 <= digits < len(_SCALES):
        return round(value, digits)
    v = value
    scale = _SCALES[digits]
    scaled = v * scale
    if not -_LARGEST_SCALED < scaled < _LARGEST_SCALED:
        return round(value, digits)
    whole = int(scaled // 1.0)  # the floor, exact here
    past_half = scaled - whole - 0.5  # exact near a tie (a difference of floats within a factor of two)
    if past_half > _TIE_MARGIN:
        whole += 1
    elif past_half > -_TIE_MARGIN:
        return round(value, digits)  # at or near a tie: round half to even on the exact value
    if whole == 0:
        return v * 0.0  # as round(): a zero with the sign of the value it rounded (-0.0 for -0.0)
    return whole / scale
