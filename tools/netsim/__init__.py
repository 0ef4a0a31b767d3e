"""Flow-level simulator of training jobs sharing links, for comparing traffic policies.

``python -m tools.netsim --help``; see docs/netsim.md.
"""
