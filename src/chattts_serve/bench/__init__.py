"""Benchmark tools of ``chattts-serve bench``: load generators and the small helpers they share."""
