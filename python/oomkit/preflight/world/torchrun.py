"""``oomkit preflight -- torchrun ...``: torchrun's ranks run as rank 0 alone.

Preflight measures rank 0 of the fake process group, and under data,
tensor and context parallelism every rank holds what rank 0 holds (a
pipeline's stages differ, and its answer says which rank 0 holds), so
starting torchrun's N workers would measure rank 0 N times, on a machine
that may have two cores. Under
preflight, torchrun reads its command line as it does (``--nnodes``,
``--nproc-per-node``, ``-m``, ``--no-python``) and hands its launch to its
agent (``launcher.api.launch_agent``, which ``torchrun`` and ``python -m
torch.distributed.run`` both reach); in the agent's place one worker is
started, rank 0 of the nodes times the processes per node, with the
environment torchrun gives that rank, and measured as any script a
launcher starts. ``--gpus`` where given above one is the world instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import ModuleType
from typing import Any

#: The module of torchrun's agent launch, which its console script and ``python -m
#: torch.distributed.run`` both reach (the second runs ``run`` itself as ``__main__``).
TORCHRUN = "torch.distributed.launcher.api"


class TorchrunAsRankZero:
    """torchrun's agent launch replaced by a run of its rank 0 alone, as a world of its size."""

    def __init__(self, settings_env: str, gpus: int) -> None:
        #: The environment variable holding the preflight's settings (JSON), handed to the worker.
        self.settings_env = settings_env
        #: ``--gpus``: where above one, the world the worker is rank 0 of.
        self.gpus = gpus

    def stand_ins(self, api: ModuleType) -> list[tuple[Any, str, Any]]:
        """The (owner, name, value) triples to set on torchrun's launcher module once it is imported."""
        if not hasattr(api, "launch_agent"):
            return []

        def launch_agent(config: Any, entrypoint: Any, args: list[Any], *_: Any, **__: Any) -> dict[int, Any]:
            per_node = int(config.nproc_per_node)
            world = self.gpus if self.gpus > 1 else int(config.max_nodes) * per_node
            code = self.run_rank_zero(entrypoint, [str(a) for a in args], world, per_node)
            if code:
                sys.exit(code)
            return {0: None}

        return [(api, "launch_agent", launch_agent)]

    def run_rank_zero(self, cmd: Any, cmd_args: list[str], world: int, per_node: int) -> int:
        """Runs rank 0 of ``world`` (``per_node`` to a node) as its own process; its exit code."""
        # ``--run-path`` (a function to call, not a command): the script in a Python of its own.
        argv = [sys.executable, "-u", *cmd_args] if callable(cmd) else [cmd, *cmd_args]
        # torchrun's placeholder for ``--local-rank=`` (a script without ``--use-env``).
        argv = [a.replace("${local_rank}", "0") for a in argv]
        env = dict(os.environ)
        settings = json.loads(env[self.settings_env])
        settings["world_size"] = world
        settings["torchrun"] = world > 1
        env[self.settings_env] = json.dumps(settings)
        env.update(
            RANK="0",
            LOCAL_RANK="0",
            GROUP_RANK="0",
            NODE_RANK="0",
            ROLE_RANK="0",
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(min(per_node, world)),
            ROLE_WORLD_SIZE=str(world),
            MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"),
            MASTER_PORT=env.get("MASTER_PORT", "29500"),
        )
        return subprocess.call(argv, env=env)
