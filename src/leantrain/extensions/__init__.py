"""What users expect around the loop, built on the callback seam (``run/hooks.py``): experiment
trackers (MLflow, W&B), early stopping, and the best checkpoints by a validation metric."""
