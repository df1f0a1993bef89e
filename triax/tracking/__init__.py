"""Where a run's numbers go: throughput, MFU and memory, and the trackers that record them."""
