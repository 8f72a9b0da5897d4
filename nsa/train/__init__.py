"""Training: the trainer (``nsa.train.trainer.Trainer``), checkpoints, telemetry, signals and distributed
set-up. Importing the package imports nothing (``nsa.train.events`` stays light for the CLI)."""
