"""Tensor parallelism over torch.distributed: one process per rank, rank 0 the engine's driver.

context.py       ParallelContext: a rank's place in the group and the collectives the layers call
step_broadcast.py one scheduled step (and its prompt-logprob plan) as one flat int32 message
launch.py        starting the group: spawned ranks on one node, or ranks started by torchrun
driver.py        the driver's worker: sends each step to the ranks, turns a rank's death into EngineDeadError
rank_worker.py   ranks 1..N-1: build their shard of the worker, then run every step the driver sends
torchrun_entry.py `torchrun ... -m pagedserve.distributed.torchrun_entry <pagedserve args>`
"""
