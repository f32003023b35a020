"""The fault-tolerant torchrun script of PyTorch's DDP tutorial ("Fault-tolerant Distributed Training with torchrun"):
a `Trainer` that saves `snapshot.pt` (MODEL_STATE, EPOCHS_RUN) every `save_every` epochs and loads it at start, so a
restarted run continues where the snapshot left it. CPU/gloo where the tutorial hard-codes CUDA; rank 0 prints one
JSON line per epoch (`{"step": ..., "loss": ...}`), the progress format shunter reads from a script's output.

    torchrun --nproc_per_node=2 examples/scripts/torchrun_snapshot.py 6 2 --snapshot_path snapshots/snapshot.pt

Under shunter (`examples/torchrun-snapshot.yaml`): `outputs: [snapshots]` keeps the snapshot, and a retry finds it
where the script looks for it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

USE_CUDA = torch.cuda.is_available()


class MyTrainDataset(Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


def ddp_setup() -> None:
    dist.init_process_group(backend="nccl" if USE_CUDA else "gloo")
    if USE_CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str, epoch_seconds: float) -> None:  # fmt: skip
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = torch.device("cuda", self.local_rank) if USE_CUDA else torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.epoch_seconds = epoch_seconds
        if os.path.exists(snapshot_path):
            print("Loading snapshot", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[self.local_rank] if USE_CUDA else None)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return float(loss.item())

    def _run_epoch(self, epoch: int) -> float:
        self.train_data.sampler.set_epoch(epoch)
        losses = [self._run_batch(s.to(self.device), t.to(self.device)) for s, t in self.train_data]
        return sum(losses) / len(losses)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        os.makedirs(os.path.dirname(self.snapshot_path) or ".", exist_ok=True)
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if self.epoch_seconds:
                time.sleep(self.epoch_seconds)
            if self.global_rank == 0:
                print(json.dumps({"step": epoch + 1, "epoch": epoch, "loss": loss}), flush=True)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str, epoch_seconds: float) -> None:
    ddp_setup()
    torch.manual_seed(0)
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=batch_size, pin_memory=USE_CUDA, shuffle=False,
                        sampler=DistributedSampler(dataset))  # fmt: skip
    Trainer(model, loader, optimizer, save_every, snapshot_path, epoch_seconds).train(total_epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt", help="Where the snapshot is saved and loaded")
    parser.add_argument("--epoch_seconds", default=0.0, type=float, help="sleep after each epoch (a slow run)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.epoch_seconds)
