"""Integrations, one module each, imported lazily: the core never imports a web framework or torch."""
