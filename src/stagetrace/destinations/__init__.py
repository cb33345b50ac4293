"""Export: OTLP exporters chosen from the standard ``OTEL_*`` variables, and the embedded default (OTLP
JSON lines on local disk) for when nothing is configured."""
