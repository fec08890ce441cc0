"""Benchmarks: workloads, a streaming load generator, serving metrics, offline throughput,
peers side by side, and plots (``kvfleet bench serve|throughput|compare|plot``)."""
