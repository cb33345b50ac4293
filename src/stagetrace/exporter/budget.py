"""The export budget: how many traces a second leave the process, whatever the load.

``keep.decide`` says why a trace is worth exporting (slow, diagnosed, errored, the healthy share). At
saturation nearly every trace is slow or diagnosed, so that alone makes export grow with load, exactly
when the host is short of CPU. The budget bounds it, before anything is built for export:

- a global token bucket (``Settings.export_budget_per_s``, burst ``export_budget_burst``) with priorities:
  an errored trace may take its last tokens, a slow or diagnosed one only while a quarter of the burst is
  left, a healthy sample only while half is;
- a bucket per *signature* (root name or route, bottleneck stage, the sorted diagnosis codes; one exporter
  serves one service), so that one frequent kind of trace cannot spend the whole budget on copies of
  itself and rare kinds still get through;
- the slowest trace of each signature in each minute is kept first: the first of the minute, then any
  that is slower than every trace kept before it in that minute by ``SLOWEST_MARGIN`` (so what is kept
  holds the minute's slowest within that margin, at a handful of traces a minute per signature). Slower
  by ``Verdict.slowness``, how far past its threshold the phase that judges it went, not by how long it
  lasted: a long stream that flowed at a healthy pace does not take the slot of a shorter one that stalled. These
  may overdraw the global bucket by up to one burst; the traces after them wait for the debt to be
  repaid, so over any long window no more than ``per_s`` a second (plus two bursts) leave.

Pure: the caller passes the time. Memory is bounded by ``max_signatures`` (least recently seen forgotten).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from stagetrace.exporter.keep import Keep
from stagetrace.settings import Settings

SLOWEST_MARGIN = 1.25  # a later trace of the minute is "the slowest so far" when this much slower
MINUTE_S = 60.0
# The share of the global burst that only higher priorities may spend (errors spend everything); one entry for
# each reason a trace is kept (``Keep.kept``).
_RESERVE = {Keep.ERROR: 0.0, Keep.SLOW: 0.25, Keep.DIAGNOSED: 0.25, Keep.HEALTHY_SAMPLE: 0.5}

Signature = tuple[str, str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    """``per_s`` None: no budget (every trace ``decide`` keeps is exported, e.g. for a Collector's own tail
    sampling)."""

    per_s: float | None = 20.0
    burst: float = 40.0
    signature_per_s: float = 5.0
    signature_burst: float = 10.0
    max_signatures: int = 1024

    @classmethod
    def from_settings(cls, settings: Settings) -> BudgetLimits:
        return cls(
            per_s=settings.export_budget_per_s,
            burst=settings.export_budget_burst,
            signature_per_s=settings.signature_budget_per_s,
            signature_burst=settings.signature_budget_burst,
            max_signatures=settings.max_budget_signatures,
        )


class TokenBucket:
    __slots__ = ("burst", "last", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.last = now

    def refill(self, now: float) -> float:
        if now > self.last:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
        return self.tokens


class _SignatureState:
    __slots__ = ("bucket", "minute", "minute_max")

    def __init__(self, bucket: TokenBucket) -> None:
        self.bucket = bucket
        self.minute = -1
        self.minute_max = 0.0  # the slowness of the slowest trace kept first this minute


class ExportBudget:
    """``admit`` turns a keep reason into the final decision: the reason itself, or ``Keep.BUDGET``."""

    def __init__(self, limits: BudgetLimits, now: float) -> None:
        self.limits = limits
        self.global_bucket = TokenBucket(limits.per_s or 0.0, limits.burst, now)
        self._signatures: OrderedDict[Signature, _SignatureState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._signatures)

    def admit(self, keep: Keep, signature: Signature, slowness: float, now: float) -> Keep:
        """``slowness``: the trace's ``Verdict.slowness`` (what ranks the slowest of the minute)."""
        if not keep.kept or self.limits.per_s is None:
            return keep
        state = self._state(signature, now)
        bucket = self.global_bucket
        bucket.refill(now)
        if self._slowest_of_minute(state, slowness, now):
            # First of all: it may overdraw the global bucket (the others then wait for the debt to be
            # repaid, so the long-run rate holds), down to one burst of debt.
            if bucket.tokens <= -self.limits.burst:
                return Keep.BUDGET
            bucket.tokens -= 1.0
            return keep
        reserve = _RESERVE[keep] * self.limits.burst
        if bucket.tokens < 1.0 + reserve:
            return Keep.BUDGET
        if keep is not Keep.ERROR:  # errors are not rationed per signature: a failing kind is always news
            if state.bucket.refill(now) < 1.0:
                return Keep.BUDGET
            state.bucket.tokens -= 1.0
        bucket.tokens -= 1.0
        return keep

    def may_admit(self, keep: Keep, now: float) -> bool:
        """Whether ``admit`` could keep a trace kept for ``keep`` now, before its signature is known (it holds
        the diagnosis codes): the global bucket has a token for its priority. What the exporter's diagnosis
        budget asks of a trace it may leave undiagnosed (every kept trace carries its diagnoses); a trace
        that would have been the slowest of its signature's minute with the bucket empty is kept only where
        it was diagnosed anyway."""
        if not keep.kept:
            return False
        if self.limits.per_s is None:
            return True
        bucket = self.global_bucket
        bucket.refill(now)
        return bucket.tokens >= 1.0 + _RESERVE[keep] * self.limits.burst

    def _state(self, signature: Signature, now: float) -> _SignatureState:
        state = self._signatures.get(signature)
        if state is None:
            limits = self.limits
            state = _SignatureState(TokenBucket(limits.signature_per_s, limits.signature_burst, now))
            self._signatures[signature] = state
            if len(self._signatures) > limits.max_signatures:
                self._signatures.popitem(False)  # the least recently seen
        else:
            self._signatures.move_to_end(signature)
        return state

    @staticmethod
    def _slowest_of_minute(state: _SignatureState, slowness: float, now: float) -> bool:
        minute = int(now / MINUTE_S)  # now >= 0
        if minute != state.minute:
            state.minute, state.minute_max = minute, slowness
            return True
        if slowness >= state.minute_max * SLOWEST_MARGIN and slowness > state.minute_max:
            state.minute_max = slowness
            return True
        return False


Kind = tuple[str, str]  # route or root name, bottleneck stage: a signature without its diagnosis codes
Stratum = tuple[Kind, Keep]  # a kind of trace and why a trace of it was worth keeping


class AdjustedCounts:
    """How many traces each kept trace stands for, so that counts and percentiles over kept traces estimate
    every request's (OpenTelemetry's adjusted count). A trace's own weight is 1, or 1 / the healthy share
    for a healthy sample (kept with that probability, on its trace id). The budget is a token bucket, not a
    coin: a trace it leaves out had no probability of its own, so it hands its weight to the next kept trace
    of its *stratum*, its kind (route or root name, bottleneck stage) and the reason it was worth keeping
    (slow, diagnosed, errored, a healthy sample), which then stands for both. A slow trace left out is carried
    by the next slow one of its kind, never by a healthy sample of it, so the slow share and the percentiles
    keep the shape of every request's. (Not by its diagnosis codes: past the exporter's CPU budget a trace
    left out may not have been diagnosed.)
    Over any run the kept traces' adjusted counts add up to every trace worth keeping but those of the last
    stretch the budget left out of each stratum. Bounded like the budget's signatures (least recently seen
    forgotten)."""

    def __init__(self, max_signatures: int = 1024) -> None:
        self._max = max_signatures
        self._carried: OrderedDict[Stratum, float] = OrderedDict()

    def left_out(self, stratum: Stratum, weight: float) -> None:
        self._carried[stratum] = self._carried.pop(stratum, 0.0) + weight
        if len(self._carried) > self._max:
            self._carried.popitem(False)  # the least recently seen

    def kept(self, stratum: Stratum, weight: float) -> float:
        """The kept trace's adjusted count: its own weight and what was handed to it."""
        return weight + self._carried.pop(stratum, 0.0)


def own_weight(keep: Keep, healthy_share: float) -> float:
    """A trace's weight before the budget: a healthy sample stands for 1 / the share of healthy traces kept."""
    return 1.0 / healthy_share if keep is Keep.HEALTHY_SAMPLE and 0.0 < healthy_share < 1.0 else 1.0


def kind_of(root_name: str, route: str | None, bottleneck: str | None) -> Kind:
    return (route or root_name, bottleneck or "")


def signature_of(root_name: str, route: str | None, bottleneck: str | None, codes: tuple[str, ...]) -> Signature:
    return (*kind_of(root_name, route, bottleneck), tuple(sorted(codes)))
