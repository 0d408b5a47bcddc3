#!/usr/bin/env python3
"""GPU check for tools/lgreco-register: the layout DDP uses on CUDA with NCCL.

usage: register_cuda_check.py MODEL_SPEC INPUT_SHAPE INPUT_HIGH CPU_FILE OUT_FILE

Builds the model on cuda:0, wraps it in DDP over NCCL (one process), attaches
lgreco.register.register_ddp(), trains three steps while a comm hook records the count
and dtype of every bucket DDP allreduces, and checks (1) the registration written on the
GPU matches what DDP allreduced after its rebuild, bucket by bucket, and (2) it equals
the layout the CLI produced on the CPU with gloo (CPU_FILE). Prints one line; exit 1 on
a mismatch. LGRECO_CHECK_DEVICE=cpu runs the same check with gloo on the CPU (to test
this script without a GPU).
"""
import json
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import lgreco.register as lgreco_register  # noqa: E402


def main():
    spec, shape, high, cpu_file, out_file = sys.argv[1:6]
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = os.environ.get("LGRECO_CHECK_DEVICE", "cuda")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = lgreco_register._load_callable(spec)().to(device)  # noqa: SLF001 (the CLI's own loader)
    ddp = DDP(model, device_ids=[0] if device == "cuda" else None)
    seen = []  # per step: [(count, dtype)]

    def record(state, bucket):
        buf = bucket.buffer()
        if bucket.index() == 0:
            seen.append([])
        seen[-1].append((buf.numel(), str(buf.dtype).replace("torch.", "")))
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    ddp.register_comm_hook(None, record)
    reg = lgreco_register.register_ddp(ddp, out_file, model_name="gpu-check")
    dims = [int(x) for x in shape.split(",")]
    for _ in range(3):
        x = torch.randint(0, int(high), dims, device=device) if int(high) > 0 else torch.randn(dims, device=device)
        out = ddp(x)
        out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
        out.float().mean().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    dist.destroy_process_group()
    if not getattr(reg, "done", False):
        print(f"FAIL no file written ({getattr(reg, 'error', None)})")
        return 1
    gpu = json.load(open(out_file))
    cpu = json.load(open(cpu_file))
    file_buckets = [(b["count"], b["dtype"]) for b in gpu["buckets"]]
    if seen[-1] != file_buckets:
        print(f"FAIL the GPU file's buckets {file_buckets[:4]}... differ from DDP's allreduce calls {seen[-1][:4]}...")
        return 1
    same = [(b["count"], [l["name"] for l in b["layers"]]) for b in gpu["buckets"]] == \
           [(b["count"], [l["name"] for l in b["layers"]]) for b in cpu["buckets"]]
    print(f"PASS {len(file_buckets)} buckets match DDP's CUDA allreduce calls; "
          f"{'same layout as the CPU/gloo file' if same else 'DIFFERENT layout from the CPU/gloo file'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
