"""`triax bench`: throughput, scaling and communication share of one training step, written
several ways (triax's trainer, a hand-written DDP loop, triax.Accelerator, triax.horovod, HF
Accelerate) and timed side by side in the same processes.

Layout: cli.py launches one torchrun job per process count and writes the report; worker.py runs
inside each job; models.py holds the benchmark models and synthetic batches; adapters/ holds one
file per way of writing the step; report.py turns raw timings into the table, JSON and chart.
gpu_suite.py is `triax doctor --gpu-suite`, the GPU acceptance; gpu_bench.py its measurements of
the trainer (throughput and MFU beside a hand-written loop, the largest batch, a snapshot's cost).
"""
