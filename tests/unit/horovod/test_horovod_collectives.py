"""Every triax.horovod collective against its definition, with real processes (gloo).

One worker script per world size checks all collectives (see horovod_workers/collectives.py):
2 processes with the disagreement check off, 3 with it on (which also covers the disagreement
errors, hvd.join and init after shutdown).
"""

import pytest

from support.horovod_support import WORKERS, child_env
from support.forked import launch

# Every test here starts processes (torchrun, launchers, scripts).
pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("processes, check", [(2, "0"), (3, "1")], ids=["2-procs-check-off", "3-procs-check-on"])
def test_collectives_match_their_definitions(processes, check):
    result = launch(processes, [str(WORKERS / "collectives.py")], timeout=300,
                    env=child_env(TRIAX_HOROVOD_CHECK=check))
    assert result.stdout.count("collectives ok") == processes, result.stdout[-2000:]
