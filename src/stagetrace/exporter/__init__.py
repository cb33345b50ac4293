"""The exporter: everything after capture (analysis, diagnosis, the verdict, the keep decision, metrics,
span building, export). It runs in its own process (``process.py``) or, with
``STAGETRACE_EXPORT_PROCESS=off``, on a thread of the application."""
