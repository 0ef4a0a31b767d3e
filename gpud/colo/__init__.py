"""The co-location loop: the colocate library on live snapshots, its API and metrics."""
