"""`triax horovodrun`: Horovod's launcher command line.

    triax horovodrun -np 4 python train.py
    triax horovodrun -np 8 -H node1:4,node2:4 python train.py
    triax horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh python train.py

Every option of Horovod 0.28's horovodrun is honoured or refused in one line
(triax.horovod.horovodrun_options, whose parser hvd.run shares); the job itself, torchrun per host
or the elastic driver, is triax.horovod.launcher's. A bad option is one line and exit code 2.
"""

from __future__ import annotations

from triax.horovod import horovodrun_options, launcher


def main(argv: list[str]) -> int:
    args = horovodrun_options.parse(argv)
    if args.check_build:
        print(horovodrun_options.check_build(), flush=True)
        return 0
    return launcher.launch(args)
