"""Engine core: pure-Python bookkeeping over integer block ids (no torch)."""
