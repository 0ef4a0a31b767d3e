"""gpud's traffic service: progress reports, DSCP tags, levels, and their enforcement.

The cluster layer uses it through :class:`gpud.net.port.TrafficPort`.
"""
