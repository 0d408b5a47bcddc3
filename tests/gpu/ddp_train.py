#!/usr/bin/env python3
"""Plain PyTorch DDP training: an MLP on scikit-learn's digits dataset.

Nothing in here knows about lgreco: tests/gpu/run.sh shim runs it unchanged, once as it
is and twice under LD_PRELOAD=liblgreco.so, and compares what it prints.

One process per rank, started like torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment; `torchrun --nproc-per-node N ddp_train.py` works), or
with --rank/--world-size. Every rank uses the same device (--device, default cuda:0):
the GPU checks run several ranks on one GPU.

    ddp_train.py [--steps 300] [--hidden 1536] [--depth 3] [--batch 32] [--lr 0.05]
                 [--seed 0] [--device cuda:0 | cpu] [--backend nccl | gloo] [--out FILE]

The data: load_digits() (1,797 images of 8x8 pixels, shipped with scikit-learn, no
download), a stratified 80/20 train/test split with a fixed seed, features standardized
with the training set's mean and deviation. Each rank draws its batches from its own
shuffle of the training set (seeded by --seed and the rank). The loss is cross-entropy
with label smoothing 0.1, so that it settles near a floor instead of going to zero and
runs can be compared by ratio. SGD with momentum 0.9.

At the end rank 0 prints one line of JSON: the final training loss (mean over the last
20 steps and all ranks), test and train accuracy of the trained model, whether every
rank ended with the same parameters, the parameter count and the time per step.

The model's builder, build_model(), is what tools/lgreco-register is pointed at
(--model tests/gpu/ddp_train.py:build_model --input-shape 32,64).
"""
import argparse
import json
import os
import time

import torch


def build_model(hidden=1536, depth=3, features=64, classes=10):
    """An MLP: features -> hidden (ReLU) x depth -> classes. 4.8M parameters by default."""
    layers, width = [], features
    for _ in range(depth):
        layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


def load_data(seed):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_train)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--backend", default=None, help="default: nccl on CUDA, gloo on the CPU")
    p.add_argument("--rank", type=int, default=None, help="default: $RANK")
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE")
    p.add_argument("--last", type=int, default=20, help="steps averaged for the final loss")
    p.add_argument("--out", default=None, help="also write rank 0's JSON here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, rank=rank, world_size=world)

    torch.manual_seed(args.seed)  # the same initial parameters on every rank (DDP also broadcasts rank 0's)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    x_train, y_train = x_train.to(device), y_train.to(device)
    model = build_model(args.hidden, args.depth, x_train.shape[1], int(y_train.max()) + 1).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    gen = torch.Generator().manual_seed(args.seed * 1000003 + rank)
    order, at = torch.randperm(len(x_train), generator=gen), 0
    losses = []
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.time()
    for _ in range(args.steps):
        if at + args.batch > len(order):
            order, at = torch.randperm(len(x_train), generator=gen), 0
        idx = order[at:at + args.batch].to(device)
        at += args.batch
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x_train[idx]), y_train[idx])
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.time() - start

    last = torch.stack(losses[-args.last:]).mean().reshape(1).double()
    dist.all_reduce(last)
    final_loss = last.item() / world

    # Replicas must end identical: the same parameter checksum on every rank.
    with torch.no_grad():
        checksum = torch.zeros(1, dtype=torch.float64, device=device)
        for i, p in enumerate(model.parameters()):
            checksum += p.double().sum() * (i + 1) + p.double().abs().sum()
        low, high = checksum.clone(), checksum.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)

        model.eval()
        test_acc = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
        train_acc = (model(x_train).argmax(1) == y_train).float().mean().item()

    result = {
        "world_size": world,
        "backend": backend,
        "device": str(device),
        "steps": args.steps,
        "params": sum(p.numel() for p in model.parameters()),
        "final_loss": round(final_loss, 6),
        "test_accuracy": round(100.0 * test_acc, 3),
        "train_accuracy": round(100.0 * train_acc, 3),
        "replicas_identical": bool(low.item() == high.item()),
        "step_ms": round(1000.0 * seconds / max(args.steps, 1), 3),
        "torch": torch.__version__,
    }
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        line = json.dumps(result, sort_keys=True)
        print(line, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
