"""Live GPU telemetry: the sampler and the immutable snapshots it produces."""
