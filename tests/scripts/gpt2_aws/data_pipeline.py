"""The GPT-2 example's data format and loader contract, written for smshim's tests: `*.json.gz`
shards with one JSON object per line (`input_ids`, `attention_mask`); only pp_rank 0 reads them,
and tells the other pipeline ranks how many batches there are (smp.broadcast over the PP group /
smp.recv_from), which then iterate placeholder batches."""

from __future__ import annotations

import gzip
import json
from typing import List, Tuple

import numpy as np
import torch

import smdistributed.modelparallel.torch as smp


class GPTPretrainingDataset(torch.utils.data.Dataset):
    def __init__(self, input_paths: List[str], max_sequence_length: int, zipped: bool = True):
        self.input_paths = input_paths
        self.max_sequence_length = max_sequence_length
        self.lines: List[str] = []
        for path in input_paths:
            opener = gzip.open if zipped else open
            with opener(path, "rt") as fh:
                self.lines.extend(fh)

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        obj = json.loads(self.lines[index])
        ids = torch.tensor(obj["input_ids"], dtype=torch.long)
        mask = torch.tensor(obj["attention_mask"], dtype=torch.long)
        if len(ids) > self.max_sequence_length:  # a random window, as the example does
            start = np.random.randint(0, len(ids) - self.max_sequence_length)
            ids = ids[start:start + self.max_sequence_length]
            mask = mask[start:start + self.max_sequence_length]
        return ids, mask


class DummyDataset(torch.utils.data.Dataset):
    """What the pipeline ranks other than pp_rank 0 iterate: their inputs are not used."""

    def __init__(self, length: int):
        self.length = length

    def __getitem__(self, index):
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)

    def __len__(self) -> int:
        return self.length


def make_sampler(data, seed: int, dp_rank: int, dp_size: int, shuffle: bool):
    return torch.utils.data.DistributedSampler(data, shuffle=shuffle, seed=seed, rank=dp_rank,
                                               num_replicas=dp_size, drop_last=True)


def create_pretraining_dataloader(input_paths: List[str], batch_size: int, max_sequence_length: int,
                                  seed: int, dp_rank: int, dp_size: int, shuffle: bool = False,
                                  zipped: bool = True):
    if smp.pp_rank() == 0:
        data = GPTPretrainingDataset(input_paths, max_sequence_length, zipped=zipped)
        sampler = make_sampler(data, seed, dp_rank, dp_size, shuffle)
        loader = torch.utils.data.DataLoader(data, sampler=sampler, batch_size=batch_size,
                                             num_workers=0, drop_last=True)
        smp.broadcast(len(loader), smp.PP_GROUP)
    else:
        n = smp.recv_from(0, smp.RankType.PP_RANK)
        loader = torch.utils.data.DataLoader(DummyDataset(n * batch_size), batch_size=batch_size,
                                             drop_last=True)
    return loader
