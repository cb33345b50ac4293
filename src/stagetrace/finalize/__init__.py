"""Off-thread work: the span processor that tracks local roots, the finalizer thread that analyses finished
traces and materialises stage spans, and the metrics it records."""
