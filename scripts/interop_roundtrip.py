#!/usr/bin/env python3
"""Round trips of whole checkpoints (model and optimizer state), bit for bit.

    PY=~/peers-venv/bin/python   # PyTorch 2.15
    $PY scripts/interop_roundtrip.py resave SRC DST    # PyTorch reads every tensor of SRC, saves DST
    $PY scripts/interop_roundtrip.py compare A B       # every tensor of A equals B's, bit for bit

Both read any sharded-safetensors directory (Tessera's checkpoints and
PyTorch's `HuggingFaceStorageWriter(dir, save_distributed=True)` ones) with
`dcp.load(..., storage_reader=HuggingFaceStorageReader(dir))`, every tensor the
metadata lists (parameters, AdamW's moments and steps), in one process.
`resave` writes DST with `HuggingFaceStorageWriter(dst, save_distributed=True)`.
`compare` exits non-zero unless both hold the same names, shapes, dtypes and bits.
"""
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def load_all(path):
    """Every tensor of the checkpoint at `path`, whole."""
    meta = HuggingFaceStorageReader(path).read_metadata()
    sd = {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(path), no_dist=True)
    return sd


def main():
    verb, a, b = sys.argv[1:4]
    if verb == "resave":
        sd = load_all(a)
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(b, save_distributed=True), no_dist=True)
        print(f"PyTorch {torch.__version__} read {len(sd)} tensors of {a} and saved them to {b}")
        return 0
    if verb != "compare":
        sys.exit(f"unknown verb {verb!r}: resave or compare")
    x, y = load_all(a), load_all(b)
    differ = sorted(k for k in x.keys() & y.keys() if x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k]))
    missing = sorted(x.keys() ^ y.keys())
    ok = not differ and not missing
    print(f"{a} vs {b}: {len(x)} tensors, {len(x) - len(differ) - len(missing)} equal bit for bit"
          + (f", differ: {differ[:5]}" if differ else "") + (f", in one only: {missing[:5]}" if missing else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
