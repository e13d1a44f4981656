"""The cluster simulation's pieces: the GPU table and cluster text, the step-time model."""
