"""The launching guide's script, with its rank's view of the job printed for the torchrun tests."""

import numpy as np

import ferro

group = ferro.init_process_group()
total = ferro.allreduce(np.array([group.rank + 1.0]))
print(f"rank {group.rank} of {group.world_size}: sum of ranks + 1 = {total[0]:.0f}", flush=True)
ferro.destroy_process_group()
group = ferro.init_process_group()  # a second group in the same attempt meets a store of its own
ferro.barrier()
print(f"rank {group.rank}: joined twice", flush=True)
ferro.destroy_process_group()
