"""Sample order (global-batch sampler), the DataLoader and the device prefetcher."""
