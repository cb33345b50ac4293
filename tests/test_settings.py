"""settings.py: every environment variable's accepted spellings and its error, every bound checked with a
message that names it, and the settings' round trip to the exporter process."""

from __future__ import annotations

import pytest

from stagetrace.analysis import DiagnosisThresholds
from stagetrace.settings import (
    DEFAULT_OUTPUT_DIR,
    Settings,
    auto_stages_from_env,
    disabled_from_env,
    env_flag,
    export_process_from_env,
    healthy_sample_from_env,
    output_dir_from_env,
    slow_threshold_from_env,
)

FLAG = "STAGETRACE_TEST_FLAG"


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "True", "yes", "YES", "on", "ON", "  on  "])
def test_env_flag_true(monkeypatch, raw):
    monkeypatch.setenv(FLAG, raw)
    assert env_flag(FLAG) is True


@pytest.mark.parametrize("raw", ["0", "false", "no", "off", "", "enabled", "2"])
def test_env_flag_false(monkeypatch, raw):
    monkeypatch.setenv(FLAG, raw)
    assert env_flag(FLAG) is False


def test_env_flag_unset(monkeypatch):
    monkeypatch.delenv(FLAG, raising=False)
    assert env_flag(FLAG) is False


SPELLINGS = [("on", True), ("TRUE", True), ("1", True), ("yes", True), ("", True), ("  ", True)]
SPELLINGS += [("off", False), ("False", False), ("0", False), ("no", False)]


@pytest.mark.parametrize(("raw", "expected"), SPELLINGS)
def test_export_process_spellings(monkeypatch, raw, expected):
    monkeypatch.setenv("STAGETRACE_EXPORT_PROCESS", raw)
    assert export_process_from_env() is expected


def test_export_process_unset_is_on(monkeypatch):
    monkeypatch.delenv("STAGETRACE_EXPORT_PROCESS", raising=False)
    assert export_process_from_env() is True
    assert Settings().export_process is True


def test_export_process_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("STAGETRACE_EXPORT_PROCESS", "sometimes")
    with pytest.raises(ValueError, match=r"^STAGETRACE_EXPORT_PROCESS must be on or off, got 'sometimes'$"):
        export_process_from_env()


@pytest.mark.parametrize(("raw", "expected"), [("0", 0.0), ("1", 1.0), ("0.25", 0.25), (" 0.5 ", 0.5)])
def test_healthy_sample_from_env(monkeypatch, raw, expected):
    monkeypatch.setenv("STAGETRACE_HEALTHY_SAMPLE", raw)
    assert healthy_sample_from_env() == expected


def test_healthy_sample_default_when_unset_or_blank(monkeypatch):
    monkeypatch.delenv("STAGETRACE_HEALTHY_SAMPLE", raising=False)
    assert healthy_sample_from_env() == 0.1
    monkeypatch.setenv("STAGETRACE_HEALTHY_SAMPLE", "  ")
    assert healthy_sample_from_env(0.3) == 0.3


@pytest.mark.parametrize("raw", ["-0.01", "1.01", "half"])
def test_healthy_sample_bad_values_name_the_variable(monkeypatch, raw):
    monkeypatch.setenv("STAGETRACE_HEALTHY_SAMPLE", raw)
    with pytest.raises(ValueError, match=rf"^STAGETRACE_HEALTHY_SAMPLE must be a number between 0 and 1, got '{raw}'$"):
        healthy_sample_from_env()


def test_slow_threshold_from_env(monkeypatch):
    monkeypatch.delenv("STAGETRACE_SLOW_THRESHOLD_MS", raising=False)
    assert slow_threshold_from_env() == 200.0
    assert slow_threshold_from_env(50.0) == 50.0
    monkeypatch.setenv("STAGETRACE_SLOW_THRESHOLD_MS", "350")
    assert slow_threshold_from_env() == 350.0
    for bad in ("0", "-1", "fast"):
        monkeypatch.setenv("STAGETRACE_SLOW_THRESHOLD_MS", bad)
        with pytest.raises(
            ValueError, match=rf"^STAGETRACE_SLOW_THRESHOLD_MS must be a number of milliseconds > 0, got '{bad}'$"
        ):
            slow_threshold_from_env()


def test_disabled_by_either_variable(monkeypatch):
    monkeypatch.delenv("STAGETRACE_DISABLED", raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    assert disabled_from_env() is False
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert disabled_from_env() is True
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("STAGETRACE_DISABLED", "1")
    assert disabled_from_env() is True


def test_auto_stages_and_output_dir(monkeypatch):
    monkeypatch.delenv("STAGETRACE_AUTO_STAGES", raising=False)
    assert auto_stages_from_env() is False
    monkeypatch.setenv("STAGETRACE_AUTO_STAGES", "on")
    assert auto_stages_from_env() is True
    monkeypatch.delenv("STAGETRACE_OUTPUT_DIR", raising=False)
    assert output_dir_from_env() == DEFAULT_OUTPUT_DIR == "stagetrace-out"
    monkeypatch.setenv("STAGETRACE_OUTPUT_DIR", "/tmp/x")
    assert output_dir_from_env() == "/tmp/x"


ROUTES_MESSAGE = r"^route_slow_thresholds_ms needs str routes and values > 0, got "


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"slow_threshold_ms": 0}, r"^slow_threshold_ms must be > 0, got 0$"),
        ({"route_slow_thresholds_ms": {"/a": 0}}, ROUTES_MESSAGE + r"'/a': 0$"),
        ({"route_slow_thresholds_ms": {1: 5}}, ROUTES_MESSAGE + r"1: 5$"),
        ({"healthy_sample": 1.5}, r"^healthy_sample must be between 0 and 1, got 1.5$"),
        ({"healthy_sample": -0.1}, r"^healthy_sample must be between 0 and 1, got -0.1$"),
        ({"max_traces_in_flight": 0}, r"^max_traces_in_flight must be >= 1$"),
        ({"max_stages_per_trace": 0}, r"^max_stages_per_trace must be >= 1$"),
        ({"max_stage_names": 0}, r"^max_stage_names must be >= 1$"),
        ({"queue_size": 0}, r"^queue_size must be >= 1$"),
    ],
)  # fmt: skip
def test_every_bound_is_checked_with_a_message_naming_it(changes, message):
    with pytest.raises(ValueError, match=message):
        Settings(**changes).validate()


def test_bounds_at_their_limits_are_valid():
    s = Settings(slow_threshold_ms=0.001, healthy_sample=0.0, max_traces_in_flight=1, max_stages_per_trace=1,
                 max_stage_names=1, queue_size=1, route_slow_thresholds_ms={"/a": 0.5})  # fmt: skip
    assert s.validate() is s
    assert Settings(healthy_sample=1.0).validate().healthy_sample == 1.0


def test_settings_cross_to_the_exporter_and_back():
    original = Settings(
        slow_threshold_ms=123.0,
        route_slow_thresholds_ms={"/gen": 2000.0},
        thresholds=DiagnosisThresholds(queueing_ms=7.0, batch_wait_share=0.6),
        healthy_sample=0.3,
        export_process=False,
        max_pending_batches=9,
    )
    data = original.to_dict()
    assert data["thresholds"]["queueing_ms"] == 7.0
    rebuilt = Settings.from_dict({**data, "a_field_from_a_newer_version": 1})
    assert rebuilt == original
    assert isinstance(rebuilt.thresholds, DiagnosisThresholds)


def test_threshold_per_route():
    s = Settings(slow_threshold_ms=200.0, route_slow_thresholds_ms={"/gen": 2000.0})
    assert s.threshold_for("/gen") == 2000.0
    assert s.threshold_for("/other") == 200.0
    assert s.threshold_for(None) == 200.0


def test_settings_from_a_dict_without_thresholds_take_the_default_thresholds():
    from stagetrace.analysis import DiagnosisThresholds
    from stagetrace.settings import Settings

    s = Settings.from_dict({"slow_threshold_ms": 50.0, "not_a_field": 1})
    assert s.slow_threshold_ms == 50.0 and s.thresholds == DiagnosisThresholds()
    assert Settings.from_dict({"thresholds": {"queueing_ms": 3.0}}).thresholds.queueing_ms == 3.0
