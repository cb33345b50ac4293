"""The ``stagetrace`` command: ``demo`` and ``report``."""
