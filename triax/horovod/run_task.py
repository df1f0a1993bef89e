"""One process of an `hvd.run` job: fetch the function, run it, hand back its result.

Started by `hvd.run` through `triax horovodrun` as `python -m triax.horovod.run_task`; see
run_function.py for how the function and the result travel (signed pickles through the caller's
TCPStore). The result is filed under this process's Horovod rank when the function returns (an
elastic job's rank may have changed on the way; hvd.init keeps HOROVOD_RANK current).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

from triax.horovod.elastic.protocol import ADDRESS_ENV
from triax.horovod.run_function import (FUNCTION, FUNCTION_KEY, JOB_ENV, KEY_ENV, RESULT, STORE_ENV, STORE_TIMEOUT_S,
                                         dumps, loads, result_key)
from triax.runtime.place import detect_place


def main() -> None:
    address, _, port = os.environ[STORE_ENV].rpartition(":")
    key, job = bytes.fromhex(os.environ[KEY_ENV]), os.environ[JOB_ENV]
    store = dist.TCPStore(address or os.environ[ADDRESS_ENV], int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    function = loads(store.get(FUNCTION_KEY), key, job, FUNCTION)
    try:
        result = function()
    except BaseException as error:
        print(f"User function raise error: {error}", file=sys.stderr, flush=True)  # Horovod's words
        raise
    rank = int(os.environ.get("HOROVOD_RANK") or detect_place().rank)
    store.set(result_key(rank), dumps(result, key, job, RESULT, rank))


if __name__ == "__main__":
    main()
