"""`dlfp bench`: paired trials of prefill policies on exact-token workloads."""
