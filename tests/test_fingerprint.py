"""The model fingerprint names the numbers a model computes with, not its files: a
record made on one machine must name the same model on another."""
import json

import torch
from safetensors.torch import load_file, save_file

from gateeng.model.loader import load
from tests.tiny import save_family


def test_the_fingerprint_follows_the_numbers_not_the_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    save_family("llama", a)
    save_family("llama", b)
    # What another transformers version or another machine's converter writes
    # differently: bookkeeping in config.json, and the tensors split over two files.
    config = json.loads((b / "config.json").read_text())
    config.update(transformers_version="0.0.1", _name_or_path="/elsewhere/on/another/machine")
    (b / "config.json").write_text(json.dumps(config, indent=4))
    tensors = load_file(str(b / "model.safetensors"))
    names = sorted(tensors)
    (b / "model.safetensors").unlink()
    save_file({n: tensors[n] for n in names[::2]}, str(b / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(b / "model-00002-of-00002.safetensors"))
    first = load(str(a), "float32").fingerprint
    assert load(str(b), "float32").fingerprint == first

    # One weight's last bit, or one number of the architecture: another model.
    name = names[0]
    bumped = {n: tensors[n] for n in names[::2]}
    bumped[name] = bumped[name].clone()
    bumped[name].view(-1).view(torch.int32)[0] ^= 1
    save_file(bumped, str(b / "model-00001-of-00002.safetensors"))
    assert load(str(b), "float32").fingerprint != first
    config["rms_norm_eps"] = 1e-5
    (a / "config.json").write_text(json.dumps(config))
    assert load(str(a), "float32").fingerprint != first
