"""`triax horovodrun`'s command line: every option of Horovod 0.28's horovodrun, each either
honoured or refused in one line that names it and what to do instead (never accepted and ignored).

triax horovodrun behaves as the horovodrun of a Horovod built with Gloo only: no MPI, no jsrun.
Options that tune Horovod's own background engine (its cycle, response cache, hierarchical and
torus allreduce, autotuner, timeline, stall check, NCCL streams, thread affinity) have nothing to
act on, since triax's collectives are torch.distributed's, and are refused; their "off" forms
(--no-autotune, --no-hierarchical-allreduce, ...) ask for what triax does and are accepted.
--config-file reads Horovod's YAML file under the same rules; an option given on the command
line wins over the file, as in Horovod. docs/horovod.md lists every option and why.
"""

from __future__ import annotations

import argparse
import os
import shlex

from triax import safe_yaml
from triax.errors import TriaxError
from triax.horovod import basics
from triax.runtime.timeouts import MAX_TIMEOUT_S, collective_timeout
from triax.version import __version__

DEFAULT_START_TIMEOUT_S = 30  # Horovod's default for --start-timeout
START_TIMEOUT_ENV = "HOROVOD_START_TIMEOUT"
ELASTIC_TIMEOUT_ENV = "HOROVOD_ELASTIC_TIMEOUT"  # the elastic driver's protocol.TIMEOUT_ENV
GLOO_TIMEOUT_ENV = "HOROVOD_GLOO_TIMEOUT_SECONDS"
LOG_LEVELS = ["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"]  # Horovod's
# Horovod's levels for its C++ backend, as torch's C++ backend (c10d) takes them
TORCH_CPP_LEVELS = {"TRACE": "INFO", "DEBUG": "INFO", "INFO": "INFO", "WARNING": "WARNING", "ERROR": "ERROR",
                    "FATAL": "FATAL"}
MAX_CONFIG_BYTES = 1 << 20

_ENGINE = "triax's collectives are torch.distributed's (gloo, NCCL), which have no such setting"
_MPI = "triax horovodrun runs gloo only (no MPI); start the processes with mpirun yourself " \
       "(mpirun -np 2 python train.py: triax.horovod runs under it)"
# dest -> (True: refused when on / None: refused whatever the value, the option as written, why / instead)
REFUSED = {
    "use_mpi": (True, "--mpi", _MPI),
    "use_jsrun": (True, "--jsrun", "triax horovodrun runs gloo only (no jsrun); start the processes with jsrun yourself"),
    "mpi_args": (None, "--mpi-args", _MPI),
    "binding_args": (None, "--binding-args", _MPI + "; bind processes with its options, or taskset/numactl"),
    "mpi_threads_disable": (None, "--mpi-threads-disable", _MPI),
    "cycle_time_ms": (None, "--cycle-time-ms", "triax has no background cycle: an asynchronous operation "
                      "starts when first waited on (docs/horovod.md); drop it"),
    "cache_capacity": (None, "--cache-capacity", "triax keeps no response cache: torch.distributed runs "
                       "collectives in call order; drop it"),
    "hierarchical_allreduce": (True, "--hierarchical-allreduce", f"{_ENGINE}; drop it"),
    "hierarchical_allgather": (True, "--hierarchical-allgather", f"{_ENGINE}; drop it"),
    "torus_allreduce": (True, "--torus-allreduce", f"{_ENGINE}; drop it"),
    "autotune": (True, "--autotune", "triax has no autotuner; set --fusion-threshold-mb yourself"),
    "autotune_log_file": (None, "--autotune-log-file", "triax has no autotuner; drop it"),
    "autotune_warmup_samples": (None, "--autotune-warmup-samples", "triax has no autotuner; drop it"),
    "autotune_steps_per_sample": (None, "--autotune-steps-per-sample", "triax has no autotuner; drop it"),
    "autotune_bayes_opt_max_samples": (None, "--autotune-bayes-opt-max-samples", "triax has no autotuner; drop it"),
    "autotune_gaussian_process_noise": (None, "--autotune-gaussian-process-noise", "triax has no autotuner; drop it"),
    "timeline_filename": (None, "--timeline-filename", "triax writes no Horovod timeline; profile with "
                          "torch.profiler instead"),
    "timeline_mark_cycles": (True, "--timeline-mark-cycles", "triax writes no Horovod timeline; drop it"),
    "stall_check": (True, "--stall-check", "triax has no stall check: a collective some rank never joins "
                    "fails after --gloo-timeout-seconds; set that instead"),
    "stall_check_warning_time_seconds": (None, "--stall-check-warning-time-seconds", "triax has no stall "
                                         "check; a stalled collective fails after --gloo-timeout-seconds"),
    "stall_check_shutdown_time_seconds": (None, "--stall-check-shutdown-time-seconds", "triax has no stall "
                                          "check; use --gloo-timeout-seconds, which fails a stalled collective"),
    "num_nccl_streams": (None, "--num-nccl-streams", f"{_ENGINE}; drop it"),
    "thread_affinity": (None, "--thread-affinity", "triax has no background thread to pin; pin the "
                        "workers with taskset or numactl"),
    "log_without_timestamp": (True, "--log-without-timestamp", "torch's backend log lines always carry "
                              "their time; drop it"),
}
# Horovod's --config-file: section -> key -> dest (the command line's)
CONFIG_KEYS = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb", "cycle_time_ms": "cycle_time_ms",
               "cache_capacity": "cache_capacity", "hierarchical_allreduce": "hierarchical_allreduce",
               "hierarchical_allgather": "hierarchical_allgather", "torus_allreduce": "torus_allreduce"},
    "autotune": {"enabled": "autotune", "log_file": "autotune_log_file", "warmup_samples": "autotune_warmup_samples",
                 "steps_per_sample": "autotune_steps_per_sample",
                 "bayes_opt_max_samples": "autotune_bayes_opt_max_samples",
                 "gaussian_process_noise": "autotune_gaussian_process_noise"},
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {"enabled": "stall_check", "warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds"},
    "library_options": {"mpi_threads_disable": "mpi_threads_disable", "num_nccl_streams": "num_nccl_streams",
                        "thread_affinity": "thread_affinity", "gloo_timeout_seconds": "gloo_timeout_seconds"},
    "logging": {"level": "log_level", "with_timestamp": "log_with_timestamp"},
}


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port in 1..65535")
    return port


def count(minimum: int, maximum: int | None = None):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{number} must be at least {minimum}")
        if maximum is not None and number > maximum:
            raise argparse.ArgumentTypeError(f"{number} must be at most {maximum}")
        return number
    return parse


def whole_seconds(text: str, variable: str) -> int:
    """A HOROVOD_*_TIMEOUT variable's whole seconds (as Horovod reads it, int()), 1 .. MAX_TIMEOUT_S."""
    stripped = text.strip()
    if not (stripped.isdigit() and len(stripped) <= len(str(MAX_TIMEOUT_S)) and 1 <= int(stripped) <= MAX_TIMEOUT_S):
        raise TriaxError(f"${variable}={text!r} is not a whole number of seconds from 1 to {MAX_TIMEOUT_S} (a week)")
    return int(stripped)


def check_timeout_environment(args: argparse.Namespace) -> None:
    """Horovod's timeout variables the job would read, checked before anything starts (each is one
    line naming it, instead of a traceback per rank later). The options win over them."""
    if args.start_timeout is None:
        start_timeout(args)
    if args.elastic_timeout is None and os.environ.get(ELASTIC_TIMEOUT_ENV, "").strip():
        whole_seconds(os.environ[ELASTIC_TIMEOUT_ENV], ELASTIC_TIMEOUT_ENV)
    text = os.environ.get(GLOO_TIMEOUT_ENV, "").strip()
    if args.gloo_timeout_seconds is None and text:
        try:
            value = float(text)
        except ValueError:
            value = text
        collective_timeout(value, source=f"${GLOO_TIMEOUT_ENV}")  # as hvd.init reads it (lifecycle.gloo_timeout)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, through the CLI's TriaxError handling
        raise TriaxError(f"horovodrun: {message}")


class _Interfaces(argparse.Action):
    """--network-interface(s): repeatable, comma-separated, gathered in order (Horovod: a set)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: str,
                 option_string: str | None = None):
        names = list(getattr(namespace, self.dest) or [])
        for name in values.split(","):
            if name.strip() and name.strip() not in names:
                names.append(name.strip())
        setattr(namespace, self.dest, names)


def _switch(group: argparse._ActionsContainer, on: str, off: str, dest: str, hidden_on: bool = False,
            hidden_off: bool = False) -> None:
    """A Horovod on/off pair writing True/False into one dest (None: not given)."""
    pair = group.add_mutually_exclusive_group()
    pair.add_argument(on, dest=dest, action="store_const", const=True, default=None,
                      help=argparse.SUPPRESS if hidden_on else None)
    pair.add_argument(off, dest=dest, action="store_const", const=False, help=argparse.SUPPRESS if hidden_off else None)


def parser() -> argparse.ArgumentParser:
    # An explicit usage line: argparse's own one, wrapped, asserts on this parser's mutually
    # exclusive groups of hidden options (an AssertionError instead of the help).
    parser = _Parser(prog="triax horovodrun", allow_abbrev=False,
                     usage="triax horovodrun [options] -np N command [args ...]",
                     description="horovodrun-compatible launcher (Horovod's options; "
                     "those triax cannot honour are refused, see docs/horovod.md)")
    parser.add_argument("-v", "--version", action="version", version=f"triax {__version__}")
    parser.add_argument("-np", "--num-proc", dest="np", type=count(1), help="total number of processes "
                        "(elastic: the number to start with)")
    parser.add_argument("-cb", "--check-build", action="store_true",
                        help="show which frameworks, controllers and tensor operations are there")
    parser.add_argument("--disable-cache", action="store_true", help="accepted: triax caches no start-up "
                        "checks, so every run checks everything")
    parser.add_argument("--start-timeout", type=count(1, MAX_TIMEOUT_S), help=f"seconds for every worker to start (default "
                        f"${START_TIMEOUT_ENV} or {DEFAULT_START_TIMEOUT_S})")
    parser.add_argument("--network-interfaces", "--network-interface", dest="nics", action=_Interfaces,
                        help="interface(s) the workers communicate over, comma-separated or repeated, e.g. eth0")
    parser.add_argument("--output-filename", help="also write each rank's output to DIR/rank.<N>/stdout and stderr")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--config-file", help="Horovod's YAML parameter file (options given here win)")
    _add_ssh(parser)
    _add_tuning(parser)
    _add_logging(parser)
    _add_hosts(parser)
    _add_elastic(parser)
    controller = parser.add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="use_gloo", action="store_true", help="accepted: gloo is what runs")
    controller.add_argument("--mpi", dest="use_mpi", action="store_true", help=argparse.SUPPRESS)
    controller.add_argument("--jsrun", dest="use_jsrun", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="print the command(s) and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, e.g. python train.py")
    return parser


def _add_ssh(parser: argparse.ArgumentParser) -> None:
    ssh = parser.add_argument_group("ssh")
    ssh.add_argument("-p", "--ssh-port", type=_port, help="ssh port for remote hosts")
    ssh.add_argument("-i", "--ssh-identity-file", help="ssh identity file for remote hosts")
    ssh.add_argument("--ssh-option", action="append", default=[], metavar="OPTION",
                     help="passed to ssh as -o OPTION (repeatable), e.g. StrictHostKeyChecking=accept-new")


def _add_tuning(parser: argparse.ArgumentParser) -> None:
    params = parser.add_argument_group("tuning")
    params.add_argument("--fusion-threshold-mb", type=count(0), help="most MB of gradients fused into one "
                        "allreduce; 0: none (HOROVOD_FUSION_THRESHOLD)")
    for option in ("--cycle-time-ms", "--cache-capacity"):
        params.add_argument(option, help=argparse.SUPPRESS)
    for name in ("hierarchical-allreduce", "hierarchical-allgather", "torus-allreduce"):
        _switch(params, f"--{name}", f"--no-{name}", name.replace("-", "_"), hidden_on=True, hidden_off=True)
    _switch(params, "--autotune", "--no-autotune", "autotune", hidden_on=True, hidden_off=True)
    for option in ("--autotune-log-file", "--autotune-warmup-samples", "--autotune-steps-per-sample",
                   "--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise"):
        params.add_argument(option, help=argparse.SUPPRESS)
    params.add_argument("--timeline-filename", help=argparse.SUPPRESS)
    _switch(params, "--timeline-mark-cycles", "--no-timeline-mark-cycles", "timeline_mark_cycles", True, True)
    _switch(params, "--stall-check", "--no-stall-check", "stall_check", hidden_on=True, hidden_off=True)
    for option in ("--stall-check-warning-time-seconds", "--stall-check-shutdown-time-seconds",
                   "--mpi-args", "--binding-args", "--num-nccl-streams", "--thread-affinity"):
        params.add_argument(option, help=argparse.SUPPRESS)
    _switch(params, "--mpi-threads-disable", "--no-mpi-threads-disable", "mpi_threads_disable", True, True)
    params.add_argument("--tcp", dest="tcp_flag", action="store_true", help="TCP only: NCCL_IB_DISABLE=1 (gloo "
                        "uses TCP anyway)")
    params.add_argument("--gloo-timeout-seconds", type=float,
                        help="seconds a collective may wait before failing (HOROVOD_GLOO_TIMEOUT_SECONDS)")


def _add_logging(parser: argparse.ArgumentParser) -> None:
    logging = parser.add_argument_group("logging")
    logging.add_argument("--log-level", choices=LOG_LEVELS, help="least level torch's distributed backend logs "
                         "(TORCH_CPP_LOG_LEVEL; TRACE and DEBUG: INFO)")
    stamps = logging.add_mutually_exclusive_group()
    stamps.add_argument("--log-with-timestamp", "--no-log-hide-timestamp", dest="log_with_timestamp",
                        action="store_const", const=True, default=None, help=argparse.SUPPRESS)
    stamps.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_without_timestamp",
                        action="store_const", const=True, default=None, help=argparse.SUPPRESS)
    stamps.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_timestamp",
                        action="store_true", help="put the time before each line of the workers' output")


def _add_hosts(parser: argparse.ArgumentParser) -> None:
    hosts = parser.add_argument_group("hosts")
    hosts.add_argument("-H", "--hosts", help="host:slots,... (default localhost:NP)")
    hosts.add_argument("-hostfile", "--hostfile", help="file with 'host slots=N' lines")
    hosts.add_argument("--master-port", type=_port, help="rendezvous port (default: a free one)")


def _add_elastic(parser: argparse.ArgumentParser) -> None:
    elastic = parser.add_argument_group("elastic")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=count(1),
                         help="fewest processes to keep training with (makes the job elastic)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=count(1), help="most processes to run")
    elastic.add_argument("--slots-per-host", "--slots", dest="slots", type=count(1),
                         help="slots of a host the discovery script lists without ':slots'")
    elastic.add_argument("--host-discovery-script", help="prints the available hosts, one 'host[:slots]' a line "
                         "(makes the job elastic)")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown_range", nargs=2, type=count(0),
                         metavar=("MIN_S", "MAX_S"), help="seconds a failing host stays blacklisted (default: forever)")
    elastic.add_argument("--elastic-timeout", type=count(1, MAX_TIMEOUT_S),
                         help="seconds to wait for enough slots (default $HOROVOD_ELASTIC_TIMEOUT or 600)")
    elastic.add_argument("--reset-limit", type=count(0), help="elastic: resets allowed (default: no limit); "
                         "fixed: restarts allowed (torchrun --max-restarts, default 0)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line with --config-file applied, or one line for the first option triax cannot honour."""
    args = parser().parse_args(argv)
    from_config = _apply_config_file(args) if args.config_file else {}
    for dest, (refused, flag, why) in REFUSED.items():
        value = getattr(args, dest)
        if value is None or (refused is True and not value):  # a switch's "off" form asks for what triax does
            continue
        if value is False:  # --no-mpi-threads-disable: an MPI setting as well
            flag = "--no-" + flag[2:]
        if dest in from_config:
            shown = "mpi" if dest == "use_mpi" else value  # the file's `controller: mpi`
            where = f"{from_config[dest]}={shown!r} in --config-file {args.config_file}"
        else:  # the option as given: its value too, unless it is a switch
            where = flag if isinstance(value, bool) else f"{flag} {shlex.quote(str(value))}"
        raise TriaxError(f"{where}: {why}")
    return args


def _apply_config_file(args: argparse.Namespace) -> dict[str, str]:
    """Set every option the file gives and the command line does not; {dest: 'section.key'} of those set."""
    path = args.config_file
    config = safe_yaml.read(path, MAX_CONFIG_BYTES, source=f"--config-file {path}") or {}
    if not isinstance(config, dict):
        raise TriaxError(f"--config-file {path} holds a {type(config).__name__}, not Horovod's sections")
    given = {}
    for section, values in config.items():
        if section == "controller":
            if str(values).lower() not in ("gloo", "mpi"):
                raise TriaxError(f"--config-file {path}: controller {values!r}: no such controller; use gloo")
            if not (args.use_gloo or args.use_mpi):
                args.use_mpi = str(values).lower() == "mpi"
                given["use_mpi"] = "controller"
            continue
        keys = CONFIG_KEYS.get(section)
        if keys is None:
            raise TriaxError(f"--config-file {path}: {section!r} is not one of Horovod's sections "
                             f"({', '.join(['controller', *CONFIG_KEYS])})")
        if not isinstance(values, dict):
            raise TriaxError(f"--config-file {path}: {section} must hold keys, e.g. {next(iter(keys))}: ...")
        for key, value in values.items():
            dest = keys.get(key)
            if dest is None:
                raise TriaxError(f"--config-file {path}: {section}.{key} is not one of Horovod's keys "
                                 f"({', '.join(keys)})")
            if dest == "stall_check":  # the file says whether the check is on; the command line says --no-
                value = bool(value)
            on_command_line = getattr(args, dest) is not None or (
                dest == "log_with_timestamp" and args.log_without_timestamp is not None)
            if not on_command_line and value is not None:
                setattr(args, dest, value)
                given[dest] = f"{section}.{key}"
    if "log_with_timestamp" in given and args.log_with_timestamp is False:
        args.log_with_timestamp, args.log_without_timestamp = None, True
        given["log_without_timestamp"] = given["log_with_timestamp"]
    _check_config_values(args, given, path)
    return given


def _check_config_values(args: argparse.Namespace, given: dict[str, str], path: str) -> None:
    """Values from the file are checked as the command line checks them."""
    if "fusion_threshold_mb" in given:
        value = args.fusion_threshold_mb
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TriaxError(f"--config-file {path}: {given['fusion_threshold_mb']}={value!r} must be a whole "
                             "number of MB, 0 or more")
    if "gloo_timeout_seconds" in given:
        args.gloo_timeout_seconds = collective_timeout(args.gloo_timeout_seconds,
                                                       f"{given['gloo_timeout_seconds']} in --config-file {path}")
    if "log_level" in given and str(args.log_level).upper() not in LOG_LEVELS:
        raise TriaxError(f"--config-file {path}: {given['log_level']}={args.log_level!r} is not one of "
                         f"{', '.join(LOG_LEVELS)}")
    if "log_level" in given:
        args.log_level = str(args.log_level).upper()


def start_timeout(args: argparse.Namespace) -> int:
    """--start-timeout, else $HOROVOD_START_TIMEOUT, else Horovod's 30 seconds."""
    if args.start_timeout is not None:
        return args.start_timeout
    text = os.environ.get(START_TIMEOUT_ENV, "").strip()
    return whole_seconds(text, START_TIMEOUT_ENV) if text else DEFAULT_START_TIMEOUT_S


def worker_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables the options set in every worker, as horovodrun sets them."""
    env = {}
    if args.gloo_timeout_seconds is not None:
        seconds = collective_timeout(args.gloo_timeout_seconds, "--gloo-timeout-seconds")
        env[GLOO_TIMEOUT_ENV] = f"{seconds:g}"
    if args.nics:
        env["GLOO_SOCKET_IFNAME"] = ",".join(args.nics)
        env["HOROVOD_GLOO_IFACE"] = args.nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(args.nics)
    if args.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(args.fusion_threshold_mb * 1024 * 1024)
    if args.tcp_flag:
        env["NCCL_IB_DISABLE"] = "1"
    if args.log_level is not None:
        env["HOROVOD_LOG_LEVEL"] = args.log_level
        env["TORCH_CPP_LOG_LEVEL"] = TORCH_CPP_LEVELS[args.log_level]
    return env


def check_build() -> str:
    """Horovod's --check-build table, for what triax has."""
    def mark(value: bool) -> str:
        return "X" if value else " "

    return "\n".join([
        f"triax {__version__} (Horovod's API on torch.distributed):", "",
        "Available Frameworks:", "    [ ] TensorFlow", "    [X] PyTorch", "    [ ] MXNet", "",
        "Available Controllers:", f"    [{mark(basics.mpi_built())}] MPI", f"    [{mark(basics.gloo_built())}] Gloo", "",
        "Available Tensor Operations:", f"    [{mark(basics.nccl_built())}] NCCL",
        f"    [{mark(basics.ddl_built())}] DDL", f"    [{mark(basics.ccl_built())}] CCL",
        f"    [{mark(basics.mpi_built())}] MPI", f"    [{mark(basics.gloo_built())}] Gloo"])
