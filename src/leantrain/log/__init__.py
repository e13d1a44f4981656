"""Metrics kept on the device, and the sinks and progress display that read them."""
