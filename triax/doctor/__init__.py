"""`triax doctor`: checks a machine and a job's cluster before a long run (command.py).

needs.py: what the configured run needs (triax plan's estimates); system.py: versions, device,
kernels, matmul rate, memory; storage.py: the snapshot directory; network.py: store, process
group, collective and per-link bandwidth, stragglers; report.py: the table and the JSON file.
entry.py hands `--gpu-suite` to gpu_suite.py (the GPU acceptance, with gpu_bench.py), the rest to command.py.
"""
