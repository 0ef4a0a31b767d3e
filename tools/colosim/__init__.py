"""Co-location simulator: GPUs, training jobs and inference services under four policies."""
