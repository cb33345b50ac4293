"""Helpers for testing code that uses stagetrace: a real OTLP receiver (gRPC and HTTP) on 127.0.0.1."""

from stagetrace.testing.otlp_receiver import OtlpReceiver, OtlpSink, ReceivedSpan

__all__ = ["OtlpReceiver", "OtlpSink", "ReceivedSpan"]
