"""`hvd.run(func, args, kwargs, num_proc=..., hosts=...)`: Horovod's programmatic launcher.

Runs `func(*args, **kwargs)` in every process of a job started as `triax horovodrun` would start
it (the same options, the same checks: fixed jobs on torchrun, elastic ones on the elastic
driver) and returns the per-rank return values in rank order (elastic: the first min_num_proc).

The function travels to the workers, and their results back, as pickles, as in Horovod: through a
TCPStore this process serves for the job. Pickles run code when loaded, so each one is signed
(HMAC-SHA256) with a key made for this job, which reaches the workers in their environment (over
ssh, on stdin). The signature covers the job's id, what the value is (the function, or a result)
and for which rank, with the pickle: nothing is loaded before its signature checks, so a process
that can reach the store but lacks the key cannot make either side run its code, and a signed
value copied under another key (rank 0's result filed as rank 1's, an earlier job's function) is
refused. When every host is this machine the store listens on loopback only, so nothing outside
it can even read the function's arguments or the results; a job on other hosts (or whose hosts a
discovery script names) needs the store on the network. A function defined in the
calling script (`__main__`) can only be sent by value, which needs cloudpickle (Horovod's own
dependency for this); without it, plain pickle sends functions by their importable name.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import pickle
import secrets
import sys
import warnings
from typing import Callable

import torch.distributed as dist

from triax.errors import TriaxError
from triax.horovod import horovodrun_options, launcher
from triax.horovod.errors import HorovodRunError, HorovodValueError
from triax.horovod.hosts import address_toward, is_local, parse_hosts
from triax.runtime.rendezvous import loopback_store

try:
    import cloudpickle as _pickler  # sends functions and lambdas by value, as Horovod does
except ImportError:  # plain pickle: importable functions only (checked in run())
    _pickler = None

STORE_ENV = "TRIAX_HOROVOD_RUN_STORE"
KEY_ENV = "TRIAX_HOROVOD_RUN_KEY"
JOB_ENV = "TRIAX_HOROVOD_RUN_JOB"
FUNCTION_KEY = "run/function"
STORE_TIMEOUT_S = 300
# What a signed value is: the function (one for every rank) or one rank's result.
FUNCTION, RESULT = "function", "result"
EVERY_RANK = -1
MAC_BYTES = 32


def result_key(rank: int) -> str:
    return f"run/result/{rank}"


def _mac(key: bytes, job: str, kind: str, rank: int, payload: bytes) -> bytes:
    # Job id (hex), kind (a word) and rank (a number) hold no newline: the header is unambiguous.
    return hmac.new(key, f"{job}\n{kind}\n{rank}\n".encode() + payload, hashlib.sha256).digest()


def dumps(value: object, key: bytes, job: str, kind: str, rank: int = EVERY_RANK) -> bytes:
    payload = (_pickler or pickle).dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _mac(key, job, kind, rank, payload) + payload


def loads(signed: bytes, key: bytes, job: str, kind: str, rank: int = EVERY_RANK):
    """The value, if it was signed with this job's key as this `kind` for this `rank`; else an
    error, and nothing was unpickled."""
    mac, payload = signed[:MAC_BYTES], signed[MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, job, kind, rank, payload)):
        whose = "every rank" if rank == EVERY_RANK else f"rank {rank}"
        raise HorovodRunError(f"hvd.run: the {kind} for {whose} in the job's store is not signed with this job's "
                              "key for it (forged, or copied from another rank or job); refusing it unread")
    return pickle.loads(payload)  # cloudpickle's output is plain pickle data


def job_store(local_only: bool):
    """The TCPStore server of one hvd.run: on loopback when every host is this one."""
    if local_only:
        return loopback_store(0, STORE_TIMEOUT_S)
    return dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))


def _check_sendable(func: Callable) -> None:
    if _pickler is None and getattr(func, "__module__", None) == "__main__":
        raise HorovodValueError(f"hvd.run({getattr(func, '__name__', func)!r}): a function defined in the script "
                                "itself can only be sent to the workers by value, which needs cloudpickle; "
                                "pip install cloudpickle, or move the function into a module")


def _argv(options: dict, executable: str) -> list[str]:
    """The `triax horovodrun` command line for these options, running run_task in each process."""
    argv = []
    for flag, value in options.items():
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *[str(v) for v in value]]
        elif flag.startswith("--"):
            argv.append(f"{flag}={value}")  # a value that starts with '-' stays the option's value
        else:
            argv += [flag, str(value)]
    return argv + ["--", executable, "-m", "triax.horovod.run_task"]


def run(func: Callable, args: tuple = (), kwargs: dict | None = None, num_proc: int | None = 1,
        min_num_proc: int | None = None, max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None, hosts: str | None = None,
        hostfile: str | None = None, host_discovery_script: str | None = None, start_timeout: int | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: bool | None = None, use_gloo: bool | None = None,
        use_mpi: bool | None = None, mpi_args: str | None = None, network_interface: str | None = None,
        network_interfaces: list[str] | None = None, executable: str | None = None, np: int | None = None,
        min_np: int | None = None, max_np: int | None = None):
    """Run `func(*args, **kwargs)` on every process of a Horovod job; the results in rank order.

    Horovod's signature and meaning (np, min_np, max_np: its deprecated names), each argument as
    its `triax horovodrun` option: `use_mpi` and `mpi_args` are refused as --mpi and --mpi-args are
    (triax horovodrun runs gloo only)."""
    if network_interface:
        network_interfaces = network_interface.split(",")
        warnings.warn("network_interface is deprecated, use network_interfaces instead", DeprecationWarning, 2)
    for old, new in (("np", "num_proc"), ("min_np", "min_num_proc"), ("max_np", "max_num_proc")):
        value = locals()[old]
        if value is not None:
            warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, 2)
    num_proc = np if np is not None else num_proc
    min_num_proc = min_np if min_np is not None else min_num_proc
    max_num_proc = max_np if max_np is not None else max_num_proc
    if hosts is not None and hostfile is not None:
        raise HorovodValueError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise HorovodValueError("Argument use_gloo and use_mpi only allow one set True.")
    _check_sendable(func)
    kwargs = {} if kwargs is None else kwargs
    options = {"-np": num_proc, "--min-np": min_num_proc, "--max-np": max_num_proc, "--slots-per-host": slots,
               "--reset-limit": reset_limit, "--blacklist-cooldown-range": cooldown_range, "-H": hosts,
               "--hostfile": hostfile, "--host-discovery-script": host_discovery_script,
               "--start-timeout": start_timeout, "-p": ssh_port, "-i": ssh_identity_file,
               "--disable-cache": bool(disable_cache), "--output-filename": output_filename,
               "--gloo": bool(use_gloo), "--mpi": bool(use_mpi), "--mpi-args": mpi_args,
               "--network-interfaces": ",".join(network_interfaces) if network_interfaces else None,
               "--verbose": bool(verbose)}
    argv = _argv(options, executable or sys.executable)
    try:
        remote = [host for host, _ in parse_hosts(hosts, hostfile, num_proc) if not is_local(host)]
    except TriaxError as error:
        raise HorovodValueError(str(error)) from None
    key, job = secrets.token_bytes(32), secrets.token_hex(8)
    elastic = host_discovery_script is not None or min_num_proc is not None
    local_only = not remote and host_discovery_script is None  # a script may name any host, later
    store = job_store(local_only)
    store.set(FUNCTION_KEY, dumps(functools.partial(func, *args, **kwargs), key, job, FUNCTION))
    # Workers on this machine only find the store on loopback. Elastic workers elsewhere find this
    # machine at the driver's address (the driver runs here too; it works out the address each host
    # reaches it at); fixed ones at ours toward the first remote host.
    address = "127.0.0.1" if local_only else "" if elastic else address_toward(remote[0])
    _launch(argv, {STORE_ENV: f"{address}:{store.port}", KEY_ENV: key.hex(), JOB_ENV: job})
    count = min_num_proc if min_num_proc is not None else num_proc  # elastic: the first min_num_proc
    return _collect_results(store, count, key, job)


def _launch(argv: list[str], extra_env: dict[str, str]) -> None:
    """Run the job as `triax horovodrun` would; its errors as Horovod's."""
    try:
        code = launcher.launch(horovodrun_options.parse(argv), extra_env=extra_env)
    except TriaxError as error:
        raise HorovodValueError(str(error)) from None
    if code != 0:
        raise HorovodRunError(f"hvd.run: one or more processes exited with a non-zero status ({code}); "
                              "their output above says why")


def _collect_results(store: dist.Store, count: int, key: bytes, job: str) -> list:
    """The first `count` ranks' results from the job's store, each checked against its signature."""
    results = []
    for rank in range(count):
        if not store.check([result_key(rank)]):
            raise HorovodRunError(f"hvd.run: rank {rank} finished without handing back a result")
        results.append(loads(store.get(result_key(rank)), key, job, RESULT, rank))
    return results
