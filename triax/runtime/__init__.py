"""The job's runtime: joining the process group and the rendezvous, the collectives triax's own code
runs, timeouts, the hang watchdog, lost peers and stragglers, threads and host memory."""
