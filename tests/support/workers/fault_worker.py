"""Run under torchrun: `triax train` with faults injected by patching the trainer from outside
(the library has no switch for them). argv: a JSON object of faults, then the train overrides.

  {"hang": {"rank": 1, "step": 6}}            rank 1 sleeps inside the forward of step 6
  {"slow_data": {"rank": 1, "seconds": 0.03}} every batch of rank 1 takes 30 ms longer
  {"slow_snapshot": {"rank": 0, "seconds": 4}} each snapshot write of rank 0 takes 4 s longer
  {"slow_first_step": {"rank": 1, "seconds": 4}} the first forward of rank 1 takes 4 s longer (a compile)
  {"late_start": {"rank": 1, "seconds": 30}}    rank 1 starts 30 s late
  {"pause_after_shard_write": {"seconds": 0.3}} every rank pauses 0.3 s after writing its shard file
                                                (a kill can then land inside a snapshot write)
"""

import json
import os
import sys
import time

from triax.train.snapshots import Snapshots
from triax.train.step import TrainingStep

faults = json.loads(sys.argv[1])
rank = int(os.environ["RANK"])


def applies(name):
    return name in faults and faults[name].get("rank", rank) == rank


# The hang and the slow first step happen inside a step's forward: after the step has said so to the
# watchdog (TrainingStep.phase("forward", ...)), before the objective's loss runs.
if applies("hang"):
    original_hang_phase = TrainingStep.phase

    def hanging_loss(self, name, step, micro=0):
        original_hang_phase(self, name, step, micro)
        if name == "forward" and step == faults["hang"]["step"]:
            with open(faults["hang"]["marker"], "w") as handle:  # when the hang began
                handle.write(str(time.time()))
            time.sleep(600)

    TrainingStep.phase = hanging_loss

if applies("slow_first_step"):
    original_slow_phase = TrainingStep.phase

    def slow_first_phase(self, name, step, micro=0):
        original_slow_phase(self, name, step, micro)
        if name == "forward" and self.first_step and micro == 0:
            time.sleep(faults["slow_first_step"]["seconds"])

    TrainingStep.phase = slow_first_phase

if applies("slow_data"):
    original_batch = TrainingStep.batch

    def slow_batch(self, *args, **kwargs):
        time.sleep(faults["slow_data"]["seconds"])
        return original_batch(self, *args, **kwargs)

    TrainingStep.batch = slow_batch

if applies("slow_snapshot"):
    original_save = Snapshots.save

    def slow_save(self):
        if self.saved_step != self.position.step:
            self.phase("snapshot", self.position.step)
            time.sleep(faults["slow_snapshot"]["seconds"])
        return original_save(self)

    Snapshots.save = slow_save

if applies("pause_after_shard_write"):
    from triax.checkpoint.shards import ShardWriter

    original_write = ShardWriter.write_data

    def paused_write(self, plan, planner):
        written = original_write(self, plan, planner)
        time.sleep(faults["pause_after_shard_write"]["seconds"])
        return written

    ShardWriter.write_data = paused_write

if applies("late_start"):
    time.sleep(faults["late_start"]["seconds"])

from triax.commands.train import main as train_main  # noqa: E402

sys.exit(train_main(sys.argv[2:]))
