"""`torchrun ... -m pagedserve.distributed.torchrun_entry <pagedserve command and flags>`: one entry for every rank.

Rank 0 runs the pagedserve command (generate, chat, serve) as `python -m pagedserve` would; its engine
finds the group torchrun set up (env:// rendezvous) instead of spawning ranks. Every other rank joins
the group and follows the driver's steps (rank_worker.follow); its configuration comes from the
driver, so of its own flags only --device is read (it picks the backend: NCCL or gloo).
Two machines, one GPU (or CPU) each:

    # on node R (0 or 1), with MASTER reachable from both:
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr MASTER --master-port 29500 \\
        -m pagedserve.distributed.torchrun_entry serve --tensor-parallel-size 2 --model /path/to/model
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0:
        from pagedserve.cli import main as cli_main

        return cli_main(argv)
    from pagedserve.distributed.launch import check_backend, init_groups
    from pagedserve.distributed.rank_worker import follow

    device = "cuda" if "--device" not in argv and _cuda_available() else _flag(argv, "--device", "cpu")
    import torch

    return follow(init_groups(rank, world, check_backend(torch.device(device), 1), None))


def _exit(code: int) -> None:
    """Ends the process after the exit handlers (the engine's: its stop message to the ranks) but before the
    interpreter's teardown, where gloo's threads can abort the process ("terminate called ...") and turn a
    finished run into a failed one for torchrun."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _flag(argv: list[str], name: str, default: str) -> str:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


if __name__ == "__main__":
    _exit(main())
