"""The model fingerprint: the name a Reproducibility record gives a model.

It is a sha256 over what the engine computes with: the ModelConfig it runs (as
canonical JSON), then every checkpoint tensor in name order (name, dtype, shape,
bytes). No file's bytes enter it. So the transformers version and the path that a
conversion writes into config.json do not change it, nor does how a writer orders
or shards tensors. A model has one fingerprint on every machine that loads the
same numbers, and a stored answer's record can be compared with another
machine's (reproducibility.differences).

A GGUF served natively (model.gguf_weights) hashes its stored tensors instead, in the
model's order: name, stored type and how it is served (as stored, or converted to
bf16), shape and the stored bytes. The same file served as stored and dequantized are
two models with two fingerprints.

A model's layout (`Fingerprint.layout`, `model_layout`) is the same less the tensors'
bytes: what a forward pass costs depends on, so that every checkpoint of one model
(each step of a training run) has one layout (engine.route_costs keys by it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Mapping

import torch

from gateeng.config import ModelConfig


# ModelConfig fields added after the fingerprint's first version, at their defaults: such
# a field enters the hash only where it differs, so a dense model keeps its fingerprint.
LATER_FIELDS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in ("qk_norm_scope", "moe")}


def _config_json(config: ModelConfig) -> str:
    fields = {k: v for k, v in dataclasses.asdict(config).items()
              if not (k in LATER_FIELDS and v == LATER_FIELDS[k])}
    return json.dumps(fields, sort_keys=True)


class Fingerprint:
    """The sha256 a fingerprint is: the ModelConfig as canonical JSON, then per tensor
    its name, kind, shape and bytes, in the order added."""

    def __init__(self, config: ModelConfig):
        self._h = hashlib.sha256(_config_json(config).encode())
        self._layout = self._h.copy()

    def add(self, name: str, kind: str, shape, data) -> None:
        """`data`: a contiguous numpy array or CPU tensor (its bytes)."""
        self.add_slices(name, kind, shape, (data,))

    def add_slices(self, name: str, kind: str, shape, slices) -> None:
        """A tensor whose bytes come as consecutive `slices` (contiguous numpy arrays or
        CPU tensors, e.g. its rows a few at a time): the same hash as its bytes whole,
        without ever holding them whole."""
        entry = json.dumps([name, kind, list(shape)]).encode()
        self._h.update(entry)
        self._layout.update(entry)
        for data in slices:
            self._h.update(data.reshape(-1).view(torch.uint8).numpy() if isinstance(data, torch.Tensor)
                           else data.reshape(-1).view("uint8"))

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def layout(self) -> str:
        """The sha256 of the ModelConfig and each tensor's name, kind and shape, in the
        order added: the fingerprint less the bytes."""
        return self._layout.hexdigest()


def model_fingerprint(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> str:
    """A checkpoint's: its tensors in name order, each with its torch dtype."""
    fp = Fingerprint(config)
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        fp.add(name, str(t.dtype), t.shape, t)
    return fp.hexdigest()


def model_layout(config: ModelConfig) -> str:
    """The layout of a model loaded from a checkpoint (loader.load): its ModelConfig
    alone, since the loader gives every weight the shape the config says, in the
    dtype it serves, whatever the checkpoint stored."""
    return hashlib.sha256(("checkpoint " + _config_json(config)).encode()).hexdigest()
