"""The cluster: one leader, one global priority order across nodes, fail-static.

::

    every node, every tick:                     the leader, each round:
      TrafficPort.local_report() + NodeView       Aggregator: fold reports per job
        -> NodeReport --gRPC, mTLS (api.py)-->      (slowest node, faults) -> LEVELLER over
        <-- Order(epoch, levels, tags, attrs) --    all jobs, cluster-wide DSCP tags (etcd)
      Fence (epoch >= newest applied; same epoch on another lease: etcd names it)
        -> TrafficPort.apply_order(...)
      no leader: keep the last order; after the grace period, the local policy

Election (``election.py``): ``single`` (the node leads itself) or ``etcd`` (a lease on
``<prefix>/leader``; the key's create revision is the epoch). ``etcd.py`` is the only
module that talks to etcd.
"""
