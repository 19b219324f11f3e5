"""``logitless bench``: memory, time and error of each op, side by side with its peers.

``registry`` (what an op and a provider are), ``ops_*`` (the ops and their providers),
``shapes`` (presets), ``measure`` (one measurement), ``child`` (one measurement in its own
process), ``runner`` (the sweep), ``report`` (table and JSON), ``plot`` (PNG).
"""
