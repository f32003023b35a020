"""A plain DeepSpeed script, as `deepspeed --num_gpus=N train_deepspeed.py --deepspeed_config ds_config.json` or
`torchrun --nproc_per_node=N ...` would run it. Under shunter: `entrypoint: {script: ..., args: [...]}`, unchanged.
"""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    # torchrun's env:// rendezvous; nccl on GPUs, gloo on CPU (DeepSpeed picks its CPU accelerator itself).
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    with open(args.deepspeed_config) as handle:
        ds_config = json.load(handle)

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 16, generator=generator)
    dataset = TensorDataset(inputs, inputs[:, :4].argmax(dim=1))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(engine.device), y.to(engine.device)
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
        if engine.global_rank == 0:
            print(f"deepspeed epoch {epoch} complete, zero stage {engine.zero_optimization_stage()}, "
                  f"loss {loss.item():.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
