#!/usr/bin/env python3
"""Writes tests/data/sharded_safetensors: a sharded safetensors checkpoint
saved by PyTorch's distributed checkpoint on 2 gloo ranks
(`HuggingFaceStorageWriter(path, save_distributed=True)`), and the same
tensors whole in `full.safetensors`.

    PY=~/peers-venv/bin/python  # PyTorch 2.15
    $PY scripts/sharded_safetensors_fixture.py tests/data/sharded_safetensors

Tensors: `w` f32 [5, 3] rows over the 2 ranks (3 + 2), `b` f32 [7] (4 + 3),
`e` bf16 [4, 6] columns (3 + 3), `r` f32 [3] replicated (one copy, written
by one rank).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_ranks import free_port, leave  # noqa: E402


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 3, generator=g),
        "b": torch.arange(7, dtype=torch.float32),
        "e": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "r": torch.randn(3, generator=g),
    }


def rank_main(rank, world, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = tensors()
    placements = {"w": Shard(0), "b": Shard(0), "e": Shard(1), "r": Replicate()}
    sd = {k: distribute_tensor(v, mesh, [placements[k]]) for k, v in full.items()}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(os.path.join(out, "shards"), save_distributed=True))
    if rank == 0:
        from safetensors.torch import save_file

        os.makedirs(os.path.join(out, "full"), exist_ok=True)
        save_file(full, os.path.join(out, "full", "full.safetensors"))
    dist.destroy_process_group()
    leave(0)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(2, sys.argv[1], free_port()), nprocs=2)
