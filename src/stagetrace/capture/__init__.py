"""Hot-path capture: what runs on the request thread. Only timestamps and ids here; spans are
built later by the exporter."""
