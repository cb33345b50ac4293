"""Reading exported traces and summarising verdicts (HTA's split): ``loader`` streams OTLP JSON lines into
traces, ``aggregate`` (pure) summarises verdicts, ``render`` prints tables and writes the HTML page."""
