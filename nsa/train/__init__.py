"""Training: the trainer, checkpoints, telemetry, signals and distributed set-up."""
