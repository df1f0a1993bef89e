"""The disagreement check: a small metadata allgather before each collective.

If rank 0 allreduces a (2, 3) tensor while rank 1 allreduces a (3, 3) one, torch.distributed may
hang or silently mix the buffers. Before each collective every rank shares a fixed-size row of
integers (kind, dtype, op, root, shape, digests); all ranks receive the same rows, so they reach
the same verdict and raise the same error together instead of hanging.

The same round lets `hvd.join()` work: a joined rank submits a JOIN row and, seeing what the
others submitted, takes part in their collective with neutral data (see joining.py).
The check is on by default; `TRIAX_HOROVOD_CHECK=0` or `hvd.init(check=False)` turns it off.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from triax.horovod.errors import HorovodInternalError, HorovodValueError
from triax.horovod import basics, compat, handles, process_sets, reduce_ops

KINDS = ["none", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
         "optimizer step", "broadcast_object", "allgather_object", "join", "optimizer layout",
         "process set"]
KIND = {name: code for code, name in enumerate(KINDS)}

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]

_ON_DEVICE = 100
MAX_DIMS = 8
# row: kind, dtype, op, root, ndim, dims[8], shape digest, extra digest, problem flag
SLOTS = 5 + MAX_DIMS + 3
PROBLEM = SLOTS - 1  # this rank refused its own arguments: 1 + the index of the class to raise (see agree)
# What a refusal raises on every rank: Horovod's class for it (RuntimeError for a failed op,
# ValueError for bad arguments such as alltoall splits). The lowest refusing rank's class wins.
PROBLEM_CLASSES = [HorovodInternalError, HorovodValueError]
_PROBLEM_BYTES = 512
_DIMS = slice(5, 5 + MAX_DIMS)
# Kinds where each rank may bring a different first dimension.
_FREE_FIRST_DIM = {KIND["allgather"], KIND["alltoall"]}
# Horovod refuses these while any rank of the set has joined (hvd.join): the active ranks raise,
# the joined ones keep waiting.
_NOT_WITH_JOIN = {"allgather": "Allgather", "broadcast": "Broadcast", "alltoall": "Alltoall",
                  "reducescatter": "Reducescatter"}
# Kinds where only the kind and root must match (object sizes differ by design).
_OBJECT_KINDS = {KIND["broadcast_object"], KIND["allgather_object"], KIND["barrier"], KIND["process set"]}


def digest(text: str) -> int:
    return zlib.crc32(text.encode())


@dataclass
class Agreement:
    """What the check learned: every rank's row, and which ranks have joined."""

    rows: torch.Tensor  # (size, SLOTS) int64
    joined: list[int]
    refused: str | None = None  # why the active ranks' collective cannot run while ranks have joined

    @property
    def active_count(self) -> int:
        return self.rows.shape[0] - len(self.joined)

    def first_dims(self) -> list[int]:
        return [int(d) if r not in self.joined else 0 for r, d in enumerate(self.rows[:, 5].tolist())]


def make_row(kind: str, tensor: torch.Tensor | None = None, op: int = -1, root: int = -1, extra: str | int = "",
             shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    row = torch.zeros(SLOTS, dtype=torch.int64)
    row[0] = KIND[kind]
    shape = tuple(tensor.shape) if tensor is not None else (tuple(shape) if shape is not None else ())
    dtype = tensor.dtype if tensor is not None else dtype
    row[1] = DTYPES.index(dtype) if dtype in DTYPES else (-1 if dtype is None else 99)
    if tensor is not None and tensor.device.type != "cpu":
        row[1] += _ON_DEVICE  # a joined rank must serve GPU collectives with a GPU buffer
    row[2], row[3], row[4] = op, root, len(shape)
    dims = list(shape[:MAX_DIMS])
    if len(shape) > MAX_DIMS:  # fold the tail so the dims still multiply to numel (join replays)
        tail = 1
        for d in shape[MAX_DIMS - 1:]:
            tail *= d
        dims[-1] = tail
    row[5:5 + len(dims)] = torch.tensor(dims, dtype=torch.int64)
    free_first = KIND[kind] in _FREE_FIRST_DIM
    row[5 + MAX_DIMS] = digest(str(shape[1:] if free_first else shape))
    row[6 + MAX_DIMS] = extra if isinstance(extra, int) else (digest(extra) if extra else 0)
    return row


def describe(row: torch.Tensor) -> str:
    values = row.tolist()
    kind = KINDS[values[0]] if 0 <= values[0] < len(KINDS) else f"kind {values[0]}"
    if kind in ("join", "barrier"):
        return kind
    parts = []
    ndim = values[4]
    if kind not in ("broadcast_object", "allgather_object", "optimizer step", "optimizer layout", "process set"):
        shape = values[5:5 + min(ndim, MAX_DIMS)]
        parts.append(f"shape={tuple(shape)}{'+…' if ndim > MAX_DIMS else ''}")
        dtype_code = values[1] % _ON_DEVICE
        parts.append(f"dtype={str(DTYPES[dtype_code]).replace('torch.', '') if 0 <= dtype_code < len(DTYPES) else '?'}")
    if values[2] >= 0:
        parts.append(f"op={reduce_ops.NAMES.get(values[2], values[2])}")
    if values[3] >= 0:
        parts.append(f"root_rank={values[3]}")
    if kind.startswith("optimizer") or kind == "process set":
        parts.append(f"layout={values[6 + MAX_DIMS]:08x}")
    return f"{kind}({', '.join(parts)})"


def _comparable(row: torch.Tensor) -> torch.Tensor:
    row = row.clone()
    if int(row[0]) in _FREE_FIRST_DIM:
        row[5] = 0
    if int(row[0]) in _OBJECT_KINDS:
        row[1], row[4:5 + MAX_DIMS + 1] = 0, 0
    return row


_rounds = 0  # check rounds this process took part in; the same count on every rank


def rounds() -> int:
    return _rounds


def replay_shape(row: torch.Tensor) -> tuple[int, ...]:
    ndim = int(row[4])
    return tuple(int(d) for d in row[5:5 + min(ndim, MAX_DIMS)])


def replay_dtype(row: torch.Tensor) -> torch.dtype:
    return DTYPES[int(row[1]) % _ON_DEVICE]


def replay_device(row: torch.Tensor) -> torch.device:
    return basics.world().device if int(row[1]) >= _ON_DEVICE else torch.device("cpu")


def gather_rows(row: torch.Tensor) -> torch.Tensor:
    global _rounds
    _rounds += 1
    size = process_sets.active_size()
    device = basics.world().device if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = torch.empty(size * SLOTS, dtype=torch.int64, device=device)
    handles.wait_one(compat.all_gather_single(rows, row.to(device), group=process_sets.active_group(), async_op=True))
    return rows.view(size, SLOTS).cpu()


def _shared_problem(problem: str | None, rows: torch.Tensor, name: str | None) -> str:
    """One message, built identically on every rank, from what each refusing rank reported."""
    size = rows.shape[0]
    mine = torch.zeros(_PROBLEM_BYTES, dtype=torch.uint8)
    if problem:
        encoded = problem.encode()[:_PROBLEM_BYTES]
        mine[:len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    device = basics.world().device if dist.get_backend() == "nccl" else torch.device("cpu")
    everyone = torch.empty(size * _PROBLEM_BYTES, dtype=torch.uint8, device=device)
    handles.wait_one(compat.all_gather_single(everyone, mine.to(device), group=process_sets.active_group(), async_op=True))
    everyone = everyone.view(size, _PROBLEM_BYTES).cpu()
    reports: dict[str, list[int]] = {}  # problem text -> ranks that reported it
    for r in range(size):
        if int(rows[r, PROBLEM]):
            text = bytes(everyone[r].tolist()).rstrip(b"\0").decode(errors="replace")
            reports.setdefault(text, []).append(process_sets.active_ranks()[r])
    reports = [f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: {text}"
               for text, ranks in reports.items()]
    label = f" {name!r}" if name else ""
    return f"Horovod collective{label} refused on every rank, nothing was exchanged — " + "; ".join(reports)


def check_rows(rows: torch.Tensor, name: str | None, problem: str | None = None) -> Agreement:
    refusing = [r for r in range(rows.shape[0]) if int(rows[r, PROBLEM])]
    if refusing:
        # Some rank refused its arguments before moving data: all raise together, same message and class.
        error_class = PROBLEM_CLASSES[int(rows[refusing[0], PROBLEM]) - 1]
        raise error_class(_shared_problem(problem, rows, name))
    joined = [r for r in range(rows.shape[0]) if int(rows[r, 0]) == KIND["join"]]
    active = [r for r in range(rows.shape[0]) if r not in joined]
    if not active:
        return Agreement(rows, joined)
    reference = _comparable(rows[active[0]])
    if any(not torch.equal(_comparable(rows[r]), reference) for r in active[1:]):
        groups: dict[str, list[int]] = {}
        ranks = process_sets.active_ranks()  # rows are in set order; name ranks globally
        for r in active:
            groups.setdefault(describe(rows[r]), []).append(ranks[r])
        found = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {what}"
                          for what, rs in groups.items())
        label = f" {name!r}" if name else ""
        raise HorovodInternalError(
            f"Horovod collective{label}: ranks disagree — {found}. Every rank must call the same "
            f"collective, in the same order, with the same shape (first dimension may differ only "
            f"for allgather/alltoall), dtype, op and root_rank "
            f"(set {basics.CHECK_ENV}=0 to skip this check)")
    kind = KINDS[int(rows[active[0], 0])]
    if joined and kind in _NOT_WITH_JOIN:
        ranks = [process_sets.active_ranks()[j] for j in joined]
        return Agreement(rows, joined, f"{_NOT_WITH_JOIN[kind]} is not supported with Join at this time "
                                       f"(ranks {ranks} have called hvd.join())")
    return Agreement(rows, joined)


def agree(kind: str, tensor: torch.Tensor | None = None, op: int = -1, root: int = -1, name: str | None = None,
          extra: str = "", shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
          problem: str | None = None, problem_class: type[Exception] = HorovodInternalError) -> Agreement | None:
    """Run the check before a collective; None when it is off or there is only one process.

    `problem`: what is wrong with this rank's own arguments, if anything. It is raised, as
    `problem_class`, on every rank (not only here), so no rank is left waiting in a collective
    the others abandoned.
    """
    world = basics.world()
    if process_sets.active_size() == 1 or not world.check:
        if problem:
            raise problem_class(problem)
        return None
    row = make_row(kind, tensor if problem is None else None, op, root, extra, shape, dtype)
    row[PROBLEM] = 1 + PROBLEM_CLASSES.index(problem_class) if problem else 0
    agreement = check_rows(gather_rows(row), name, problem)
    if agreement.refused:
        raise HorovodInternalError(agreement.refused)
    return agreement
