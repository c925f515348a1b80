#!/usr/bin/env python3
"""PyTorch's distributed checkpoint reads a Tessera checkpoint.

    PY=~/peers-venv/bin/python   # PyTorch 2.15
    $PY scripts/interop_pytorch.py CHECKPOINT_DIR FULL.safetensors [WORLD [RESAVE_DIR]]

On WORLD gloo ranks (default 2), every tensor of FULL (a consolidated state
dict, as `train --save-full` writes it) is loaded from CHECKPOINT_DIR with
`dcp.load(..., storage_reader=HuggingFaceStorageReader(dir))` into a DTensor
sharded along its first dim, and compared bit for bit with FULL; with
RESAVE_DIR, PyTorch then saves them there as sharded safetensors
(`HuggingFaceStorageWriter(dir, save_distributed=True)`). Exits non-zero on
any difference.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_ranks import free_port, leave  # noqa: E402


def rank_main(rank, world, ckpt, full_path, port, resave):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    from safetensors.torch import load_file

    full = load_file(full_path)
    sd = {
        k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0) if v.dim() > 0 else Replicate()])
        for k, v in full.items()
    }
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt))
    bad = [k for k, v in full.items() if not torch.equal(sd[k].full_tensor(), v)]
    if resave:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(resave, save_distributed=True))
    if rank == 0:
        print(f"PyTorch {torch.__version__} on {world} ranks read {len(full)} tensors of {ckpt}: "
              f"{len(full) - len(bad)} equal bit for bit" + (f", differ: {bad[:5]}" if bad else ""))
    dist.destroy_process_group()
    leave(1 if bad else 0)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    ckpt, full = sys.argv[1], sys.argv[2]
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    resave = sys.argv[4] if len(sys.argv) > 4 else None
    mp.spawn(rank_main, args=(world, ckpt, full, free_port(), resave), nprocs=world)
