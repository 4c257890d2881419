"""The model fingerprint: the name a Reproducibility record gives a model.

It is a sha256 over what the engine computes with: the ModelConfig it runs (as
canonical JSON), then every checkpoint tensor in name order (name, dtype, shape,
bytes). No file's bytes enter it. So the transformers version and the path that a
conversion writes into config.json do not change it, nor does how a writer orders
or shards tensors. A model has one fingerprint on every machine that loads the
same numbers, and a stored answer's record can be compared with another
machine's (reproducibility.differences).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Mapping

import torch

from gateeng.config import ModelConfig


def model_fingerprint(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256(json.dumps(dataclasses.asdict(config), sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
