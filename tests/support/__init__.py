"""What the tests share: helpers, checkpoint writers, process launchers, and the scripts the tests
start in processes of their own (workers/, horovod_workers/, accelerate_scripts/).

The test folders mirror triax's packages (tests/unit/<package>/) with the end-to-end stories apart
(tests/e2e/); a test imports its helpers from here (`from support.helpers import train`), the
tests/ folder being on sys.path (pyproject's [tool.pytest.ini_options] pythonpath)."""

import os

SUPPORT_DIR = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.dirname(SUPPORT_DIR)
REPO_DIR = os.path.dirname(TESTS_DIR)
WORKERS_DIR = os.path.join(SUPPORT_DIR, "workers")
HOROVOD_WORKERS_DIR = os.path.join(SUPPORT_DIR, "horovod_workers")
ACCELERATE_SCRIPTS_DIR = os.path.join(SUPPORT_DIR, "accelerate_scripts")
