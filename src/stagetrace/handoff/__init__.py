"""The hand-off from the application to the exporter: the span processor that collects each trace, the
helper thread that packs it, the wire format and the channel."""
