"""torch's advice to its own developers, kept out of triax's output.

DTensor logs a warning on every rank when a redistribution takes two collectives, e.g. the
gradient norm of an FSDP x TP run (`_NormPartial(2.0)` over `dp_shard` and `tp`: "flatten mesh
dimensions ..."): four processes printed the same paragraph four times between triax's lines,
about an optimisation inside torch that a user of `triax train` can do nothing about. Records up to
WARNING from DTensor's module loggers are dropped (errors still show); --debug or TRIAX_DEBUG=1
keeps them all. A filter on each logger, not a level: torch sets its loggers' levels when it is
imported (TORCH_LOGS), which would undo a level set before.
"""

from __future__ import annotations

import logging
import warnings

# DTensor's modules that log (logging.getLogger(__name__)); a record is checked by the logger it
# was made on, so each is named.
DTENSOR_LOGGERS = tuple(f"torch.distributed.tensor.{name}" for name in (
    "_redistribute", "_utils", "_random", "_collective_utils", "_dispatch", "_sharding_prop",
    "_ops.single_dim_strategy"))


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno > logging.WARNING


def quiet_torch_logs(debug: bool) -> None:
    """Drop DTensor's warnings (and its Python UserWarnings) from this process's output, unless debugging."""
    if debug:
        return
    for name in DTENSOR_LOGGERS:
        logger = logging.getLogger(name)
        if _errors_only not in logger.filters:
            logger.addFilter(_errors_only)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.tensor")
