"""The bottom layer that capture, the hand-off and the exporter process share: the wire records and their
field tables (``wire.py``), the channel's framing (``channel.py``) and the reading of Linux scheduler
counters (``schedstat.py``). It imports nothing of stagetrace above it, so every arrow points down here."""
