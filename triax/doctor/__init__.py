"""The checks of `triax doctor` (triax.commands.doctor) and of a run's `trainer.preflight`: a
machine and a job's cluster before a long run (readiness.py).

needs.py: what the configured run needs (triax plan's estimates); system.py: versions, device,
kernels, matmul rate, memory; storage.py: the snapshot directory; network.py: store, process
group, collective and per-link bandwidth, stragglers; report.py: the table and the JSON file.
`triax doctor --gpu-suite`, the GPU acceptance, is triax.bench.gpu_suite: it times the trainer.
"""
