"""Where the work runs: the cluster environment, and the parallel plan applied to the model."""
