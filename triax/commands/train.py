"""`triax train`: compose the configuration, prepare the run, run the Trainer, leave the process group
cleanly."""

from __future__ import annotations

from triax.runtime.shared_decisions import barrier
from triax.errors import TriaxError
from triax.runtime.lost_peers import PeerLostError, lost_peer_message
from triax.runtime.process_group import shutdown_distributed
from triax.config import compose_run, describe_keys

TRAIN_HELP = """usage: triax train [key=value ...] [model=PRESET] [+experiment=NAME]

Train a GPT (or, with model.arch=llama or model=llama-debug, a Llama). With no arguments: a small
GPT (500 steps) on the built-in corpus (minutes on 2 CPU cores; the progress bar and each log line
show the time left). Run under torchrun (or `triax launch`) for several processes.

examples:
  triax train
  triax train model=gpt-mini trainer.max_steps=1000 data.path=input.txt
  triax train data.task=addition trainer.max_steps=2000
  triax train model=llama-debug trainer.max_steps=1000
  triax train model.init_from=path/to/hf-llama data.task=tokens data.path=tokens/
  triax train data.task=tokens data.path=tokens/   # a directory from `triax tokenize` or nanoGPT
  torchrun --nproc-per-node 4 -m triax train trainer.precision=bf16

Only the keys below exist (with or without +); values are literal (no ${...} interpolation).
hydra.searchpath=[file://DIR] lets +experiment=NAME read your own DIR/experiment/NAME.yaml.

keys (default, meaning):
"""


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(TRAIN_HELP + describe_keys())
        return 0
    # trainer.continue_from's run, opened once for its settings, is handed on to the run's preparation.
    config, continued = compose_run(argv)
    from triax.train.prepare import prepare_run  # deferred: start-up time; a bad key or --help needs no data
    from triax.train.trainer import Trainer  # deferred: start-up time; a bad key or --help needs no trainer

    try:
        # Resolved before the Trainer (the checkpoint's architecture, the batch, the paths), which
        # trains the prepared run as it is given.
        trainer = Trainer(prepare_run(config, continued))
        trainer.fit()
        # Free the DDP model while the process group is still registered, so the group's teardown
        # below (which first lets gloo's threads finish their last works) is the last one.
        del trainer
        barrier()
    except RuntimeError as error:
        message = lost_peer_message(error)
        if message is None or isinstance(error, TriaxError):
            raise
        raise PeerLostError(message) from error
    finally:
        shutdown_distributed()
    return 0
