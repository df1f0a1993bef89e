"""`hvd.run(func, args, kwargs, num_proc=..., hosts=...)`: Horovod's programmatic launcher.

Runs `func(*args, **kwargs)` in every process of a job started as `triax horovodrun` would start
it (the same options, the same checks: fixed jobs on torchrun, elastic ones on the elastic
driver) and returns the per-rank return values in rank order (elastic: the first min_num_proc).

The function travels to the workers, and their results back, as pickles, as in Horovod: through a
TCPStore this process serves for the job. Pickles run code when loaded, so each one is signed
with a key made for this job (HMAC-SHA256) that reaches the workers in their environment (over
ssh, on stdin), and nothing is loaded before its signature checks: a process that can reach the
store but does not hold the key cannot make either side run its code. A function defined in the
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

import torch.distributed as dist

from triax.errors import TriaxError
from triax.horovod import horovodrun
from triax.horovod.errors import HorovodRunError, HorovodValueError
from triax.horovod.hosts import address_toward, is_local, parse_hosts

try:
    import cloudpickle as _pickler  # sends functions and lambdas by value, as Horovod does
except ImportError:  # plain pickle: importable functions only (checked in run())
    _pickler = None

STORE_ENV = "TRIAX_HOROVOD_RUN_STORE"
KEY_ENV = "TRIAX_HOROVOD_RUN_KEY"
FUNCTION_KEY = "run/function"
STORE_TIMEOUT_S = 300


def result_key(rank: int) -> str:
    return f"run/result/{rank}"


def dumps(value, key: bytes) -> bytes:
    payload = (_pickler or pickle).dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return hmac.new(key, payload, hashlib.sha256).digest() + payload


def loads(signed: bytes, key: bytes):
    """The value, if its signature is this job's; else an error, and nothing was unpickled."""
    mac, payload = signed[:32], signed[32:]
    if not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()):
        raise HorovodRunError("hvd.run: a value in the job's store is not signed with the job's key; refusing it")
    return pickle.loads(payload)  # cloudpickle's output is plain pickle data


def _check_sendable(func) -> None:
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
        else:
            argv += [flag, str(value)]
    return argv + ["--", executable, "-m", "triax.horovod.run_task"]


def run(func, args=(), kwargs=None, num_proc=1, min_num_proc=None, max_num_proc=None, slots=None,
        reset_limit=None, cooldown_range=None, hosts=None, hostfile=None, host_discovery_script=None,
        start_timeout=None, ssh_port=None, ssh_identity_file=None, disable_cache=None, output_filename=None,
        verbose=None, use_gloo=None, use_mpi=None, mpi_args=None, network_interface=None,
        network_interfaces=None, executable=None, np=None, min_np=None, max_np=None):
    """Run `func(*args, **kwargs)` on every process of a Horovod job; the results in rank order.

    Horovod's signature and meaning (np, min_np, max_np: its deprecated names). `disable_cache`,
    `output_filename` and `mpi_args` are accepted and have no effect; `use_mpi` runs the same job
    (triax's collectives are torch.distributed's either way)."""
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
               "--network-interface": ",".join(network_interfaces) if network_interfaces else None,
               "--verbose": bool(verbose)}
    argv = _argv(options, executable or sys.executable)
    try:
        remote = [host for host, _ in parse_hosts(hosts, hostfile, num_proc) if not is_local(host)]
    except TriaxError as error:
        raise HorovodValueError(str(error)) from None
    key = secrets.token_bytes(32)
    store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    store.set(FUNCTION_KEY, dumps(functools.partial(func, *args, **kwargs), key))
    elastic = host_discovery_script is not None or min_num_proc is not None
    # Elastic workers find this machine at the driver's address (the driver runs here too; it
    # works out the address each host reaches it at); fixed ones at ours toward the first remote host.
    address = "" if elastic else address_toward(remote[0]) if remote else "127.0.0.1"
    try:
        code = horovodrun.main(argv, extra_env={STORE_ENV: f"{address}:{store.port}", KEY_ENV: key.hex()})
    except TriaxError as error:
        raise HorovodValueError(str(error)) from None
    if code != 0:
        raise HorovodRunError(f"hvd.run: one or more processes exited with a non-zero status ({code}); "
                              "their output above says why")
    count = min_num_proc if min_num_proc is not None else num_proc  # elastic: the first min_num_proc
    results = []
    for rank in range(count):
        if not store.check([result_key(rank)]):
            raise HorovodRunError(f"hvd.run: rank {rank} finished without handing back a result")
        results.append(loads(store.get(result_key(rank)), key))
    return results
