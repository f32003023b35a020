"""The plain DDP torchrun script of the distributed-training guide, unchanged except where it hard-codes CUDA.

Launch it with `torchrun --nproc_per_node=2 examples/scripts/train_ddp.py`, or under shunter with
`entrypoint: {script: examples/scripts/train_ddp.py, args: [--epochs, "2"]}`: the same file either way.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

USE_CUDA = torch.cuda.is_available()


def YourModel():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def YourDataset():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 16, generator=generator)
    return TensorDataset(inputs, inputs[:, :4].argmax(dim=1))


def setup():
    """Initialize distributed process group (torchrun's env:// rendezvous)"""
    dist.init_process_group("nccl" if USE_CUDA else "gloo")
    if USE_CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def cleanup():
    dist.destroy_process_group()


def train(epochs=10, env_out=None):
    setup()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if USE_CUDA else torch.device("cpu")
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID")  # fmt: skip
    env = {name: os.environ.get(name) for name in names}
    print(f"rank {rank} env {json.dumps(env)}", flush=True)
    if env_out:
        with open(os.path.join(env_out, f"env-rank{rank}.json"), "w") as handle:
            json.dump(env, handle)

    # Create model and move to device
    model = YourModel().to(device)
    model = DDP(model, device_ids=[device.index] if USE_CUDA else None)

    # Distributed sampler ensures each worker gets different data
    dataset = YourDataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    dataloader = DataLoader(dataset, batch_size=32, sampler=sampler)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # Shuffle differently each epoch

        for batch in dataloader:
            inputs, labels = batch
            inputs = inputs.to(device)
            labels = labels.to(device)

            optimizer.zero_grad()
            outputs = model(inputs)
            loss = nn.functional.cross_entropy(outputs, labels)
            loss.backward()  # Gradients synchronized automatically
            optimizer.step()

        if rank == 0:
            print(f"Epoch {epoch} complete, loss {loss.item():.4f}", flush=True)

    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--env-out", default=None, help="write each rank's torchrun environment here")
    args = parser.parse_args()
    train(args.epochs, args.env_out)
