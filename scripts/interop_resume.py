#!/usr/bin/env python3
"""PyTorch continues a run from a Tessera checkpoint, and saves one that Tessera
continues from: the tiny reference models trained as `train` trains them.

    PY=~/peers-venv/bin/python   # PyTorch 2.15
    $PY scripts/interop_resume.py --model gpt|llama --mode fsdp|fsdp_tp --steps N \\
        [--resume DIR --first K] [--save DIR --save-after K] --losses-out PATH

fsdp runs on 2 gloo ranks (FSDP2's fully_shard on every block and the root),
fsdp_tp on 4 (TP over the inner dim of a 2 x 2 mesh, then fully_shard over the
outer). The models start from tests/data's initial weights; step s reads the
first 8 rows of tokens[s] of tests/data/tiny_tokens_G16.safetensors, each
data-parallel rank its share; AdamW(lr 1e-3, betas (0.9, 0.95), eps 1e-8,
weight decay 0.1) and the mean cross entropy, as `train` runs them.

Checkpoints use Tessera's keys in PyTorch's sharded safetensors layout:
parameters by name, AdamW's state as optim.NAME.exp_avg, optim.NAME.exp_avg_sq
and optim.NAME.step (one i64). --resume loads one (dcp.load with
HuggingFaceStorageReader) into the sharded model and optimizer before step K;
--save writes one after step K (HuggingFaceStorageWriter, save_distributed).
Rank 0 writes the losses of the steps it ran as {"loss": [...]}.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import ModelArgs, Transformer  # noqa: E402
from torch_llama import Llama, LlamaArgs  # noqa: E402
from torch_llama import parallelize_tp as parallelize_tp_llama  # noqa: E402
from gloo_ranks import free_port, leave  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data")
GLOBAL_BATCH = 8


def parallelize_tp_gpt(model, tp_mesh):
    """Megatron-style TP without sequence parallelism, as `train --tp` lays out
    the GPT model: embeddings row-wise, q/k/v and w1 column-wise, wo and w2
    row-wise, the head column-wise gathered to Replicate logits."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
        })
        layer.attention.n_heads //= tp_mesh.size()


def build(a, mesh):
    """The sharded model and its optimizer."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard

    if a.model == "llama":
        model = Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32,
                                ffn_hidden=192, rope_theta=10000.0))
        init = "llama_tiny_init.safetensors"
    else:
        model = Transformer(ModelArgs(n_layers=2, vocab_size=256, max_seq_len=32, dim=64, n_heads=4))
        init = "tiny_init.safetensors"
    model.load_state_dict(load_file(os.path.join(DATA, init)), strict=True)
    dp = mesh
    if a.mode == "fsdp_tp":
        (parallelize_tp_llama(model, mesh["tp"], sp=False) if a.model == "llama"
         else parallelize_tp_gpt(model, mesh["tp"]))
        dp = mesh["dp"]
    for layer in model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return model, opt


def checkpoint_state(model, opt, fresh):
    """The state dict under Tessera's keys: the parameters themselves (DTensors,
    loaded in place), and AdamW's state (fresh tensors to load into, or the
    optimizer's own)."""
    sd = {}
    for name, p in model.named_parameters():
        sd[name] = p.detach()
        if fresh:
            sd[f"optim.{name}.exp_avg"] = torch.zeros_like(p.detach())
            sd[f"optim.{name}.exp_avg_sq"] = torch.zeros_like(p.detach())
            sd[f"optim.{name}.step"] = torch.zeros(1, dtype=torch.int64)
        else:
            st = opt.state[p]
            sd[f"optim.{name}.exp_avg"] = st["exp_avg"]
            sd[f"optim.{name}.exp_avg_sq"] = st["exp_avg_sq"]
            sd[f"optim.{name}.step"] = torch.tensor([int(st["step"].item())], dtype=torch.int64)
    return sd


def rank_main(rank, world, a, port):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh

    import warnings

    # The models return views (their logits); nothing here writes to them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if a.mode == "fsdp":
        mesh, dp_size, dp_rank = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), world, rank
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_size, dp_rank = world // 2, rank // 2
    model, opt = build(a, mesh)
    if a.resume:
        sd = checkpoint_state(model, opt, fresh=True)
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(a.resume))
        for name, p in model.named_parameters():
            opt.state[p] = {
                "step": torch.tensor(float(sd[f"optim.{name}.step"][0])),
                "exp_avg": sd[f"optim.{name}.exp_avg"],
                "exp_avg_sq": sd[f"optim.{name}.exp_avg_sq"],
            }
    tokens = load_file(os.path.join(DATA, "tiny_tokens_G16.safetensors"))["tokens"]
    rows = GLOBAL_BATCH // dp_size
    losses = []
    for s in range(a.first, a.steps):
        batch = tokens[s][:GLOBAL_BATCH][dp_rank * rows:(dp_rank + 1) * rows]
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.detach().clone()
        dist.all_reduce(lv, op=dist.ReduceOp.SUM)
        losses.append(float(lv) / world)  # tp ranks of a dp group hold the same loss
        if a.save and s + 1 == a.save_after:
            dcp.save(checkpoint_state(model, opt, fresh=False),
                     storage_writer=HuggingFaceStorageWriter(a.save, save_distributed=True))
    if rank == 0:
        with open(a.losses_out, "w") as f:
            json.dump({"loss": losses, "first_step": a.first, "torch": torch.__version__}, f)
    dist.destroy_process_group()
    leave(0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["gpt", "llama"], required=True)
    p.add_argument("--mode", choices=["fsdp", "fsdp_tp"], required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--resume")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--save")
    p.add_argument("--save-after", type=int, default=0)
    p.add_argument("--losses-out", required=True)
    a = p.parse_args()
    if bool(a.resume) != (a.first > 0):
        p.error("--resume and --first go together")
    import torch.multiprocessing as mp

    world = 2 if a.mode == "fsdp" else 4
    mp.spawn(rank_main, args=(world, a, free_port()), nprocs=world)


if __name__ == "__main__":
    main()
