"""Weights in place: a new checkpoint for a running engine, read, checked and built
aside, on the caller's thread.

`prepare` touches nothing the engine serves. It reads a directory as `--model` does
(config.json and *.safetensors under transformers' names; the tokenizer stays the
server's, so none is read) and checks it against the served model: the same
ModelConfig; every tensor the model reads present, none extra, none in two files
(a mixture of experts' expert weights one tensor per expert or fused, as
transformers 5 writes them, model.experts; never both for one weight); each with the served shape, a floating dtype, and finite values, also once rounded
to the served dtype. Then it builds the new model and its plans through
plans.factory, as a fresh start on that directory would (packed weights included),
and fingerprints the checkpoint as the loader does. Any failure raises
WeightsRefused naming the tensor or file; the old weights keep serving, untouched.
EngineCore.apply_weight_update swaps the result in between two steps.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from gateeng.config import EngineConfig, ModelConfig
from gateeng.engine.errors import WeightsRefused, WeightUpdateUnavailable
from gateeng.model import families
from gateeng.model.experts import fused_parts, per_expert
from gateeng.model.fingerprint import model_fingerprint
from gateeng.model.llama import LlamaModel
from gateeng.model.loader import DTYPES, read_model_config, weight_files
from gateeng.plans import factory

# Checkpoint dtypes (safetensors' names) that convert to a served dtype as `--model`
# converts them: floating types of 16 bits or more. Integer, boolean and 8-bit
# float tensors are refused.
FLOATING = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
# A refusal names at most this many problems (and how many more there are).
SHOWN = 8
# What a request ended by an update carries beside finish_reason abort.
ENDED = "ended by a weight update"


@dataclass(frozen=True)
class WeightUpdate:
    """What an applied update reports."""
    model_fingerprint: str
    weight_version: int
    seconds: float          # from the call to the swap, the wait for requests in flight included
    requests_ended: int     # requests ended (finish_reason abort) so that none mixes two versions


@dataclass
class Prepared:
    """A new model with its plans, built aside and ready to swap in."""
    model: LlamaModel
    plans: factory.Plans
    fingerprint: str
    read_seconds: float     # reading and checking the checkpoint
    build_seconds: float    # the model and its plans (packing), and the fingerprint's end


def expected_shapes(cfg: ModelConfig) -> dict:
    """Every tensor LlamaModel.load_hf_state_dict reads for `cfg`, by transformers'
    name (the family's table), with its shape. A tied lm_head is not among them (the
    embedding serves)."""
    block = families.of(cfg).block
    shapes = {w.hf[0]: w.shapes(cfg)[0] for w in (block.embed, block.norm)}
    for _, _, w, names in block.tensors(cfg):
        shapes.update(zip(names, w.shapes(cfg)))
    if not cfg.tie_word_embeddings:
        shapes[block.lm_head.hf[0]] = block.lm_head.shapes(cfg)[0]
    return shapes


def refuse_unless_supported(cfg: EngineConfig, quantized: bool = False) -> None:
    """Fail closed where swapping weights is not built: no CUDA engine has been proved
    to swap correctly, and a checkpoint is not the quantized model a GGUF served as
    stored is. (At tensor-parallel sizes > 1 every rank swaps its own shard:
    engine.tp_weights.)"""
    if quantized:
        raise WeightUpdateUnavailable(
            "this server serves a GGUF's quantized weights as stored, and a checkpoint holds bf16 or float32 "
            "weights: start it with --dequantize to update its weights in place")
    if cfg.device != "cpu":
        raise WeightUpdateUnavailable(f"weights cannot be updated in place on {cfg.device}: restart the server "
                                      f"on the new weights")


def prepare(cfg: EngineConfig, served: ModelConfig, path) -> Prepared:
    """The checkpoint in directory `path`, checked against the served model and built
    with its plans (see the module doc). Raises WeightsRefused."""
    t0 = time.perf_counter()
    new, files = checked_files(served, path)
    dtype = DTYPES[cfg.dtype]
    raw, converted = _read_checked(files, served, dtype)
    # The loader's fingerprint over the checkpoint as stored, hashed while the model
    # is built and packed (hashlib lets the GIL go on large buffers).
    fingerprint: list = []
    hashing = threading.Thread(target=lambda: fingerprint.append(model_fingerprint(new, raw)),
                               name="gateeng-fingerprint", daemon=True)
    hashing.start()
    read_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    model = LlamaModel(served, dtype, cfg.device)
    model.load_hf_state_dict(converted)
    del converted
    plans = factory.build(cfg, model, served, dtype, owned=True)
    plans.release_threads()   # this thread's OpenMP pool; the engine thread has its own
    hashing.join()
    build_seconds = time.perf_counter() - t1
    if not fingerprint:
        raise RuntimeError("fingerprinting the new checkpoint failed")
    return Prepared(model, plans, fingerprint[0], read_seconds, build_seconds)


def checked_files(served: ModelConfig, path) -> tuple:
    """(the checkpoint's ModelConfig, its *.safetensors files) for directory `path`,
    whose config.json is the served model's. Raises WeightsRefused."""
    if not str(path or ""):
        raise WeightsRefused("no path given: name a directory on the server")
    hf_dir = Path(path)
    if not hf_dir.is_dir():
        raise WeightsRefused(f"{path}: not a directory (a Hugging Face directory with config.json and "
                             f"*.safetensors is expected)")
    try:
        new = read_model_config(hf_dir)
    except (OSError, ValueError, TypeError, AttributeError) as exc:   # missing, not JSON, fields absent
        raise WeightsRefused(f"{hf_dir / 'config.json'}: {exc}") from None
    differs = [f"{f.name} {getattr(served, f.name)!r} expected, got {getattr(new, f.name)!r}"
               for f in fields(ModelConfig) if getattr(served, f.name) != getattr(new, f.name)]
    if differs:
        raise WeightsRefused(f"{hf_dir / 'config.json'}: not the served model's architecture: " + "; ".join(differs))
    try:
        return new, weight_files(hf_dir)
    except OSError as exc:   # none there, or the directory is unreadable
        raise WeightsRefused(f"{hf_dir}: {exc}") from None


def _shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _values(n: int) -> str:
    return "1 value is" if n == 1 else f"{n} values are"


def _refuse(problems: list) -> None:
    if problems:
        more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise WeightsRefused("; ".join(problems[:SHOWN]) + more)


def non_finite(t: torch.Tensor) -> int:
    """How many values of t are NaN or Inf. A finite sum means every value is finite
    (IEEE addition carries a NaN or an Inf to the end), so one reduction without a
    mask decides the usual case; the count is made only where the sum is not finite
    (a value is not, or the sum overflowed)."""
    if t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return 0
    return int(t.numel() - torch.isfinite(t).sum())


def tied_differs(served: ModelConfig) -> str:
    """The refusal of a checkpoint whose lm_head config.json ties to the embedding but
    whose stored values differ from it."""
    block = families.of(served).block
    return f"{block.lm_head.hf[0]}: config.json ties it to {block.embed.hf[0]}, but the values differ"


def check_headers(files: list, served: ModelConfig, dtype) -> tuple:
    """({file: its open handle}, {tensor name: its file}) once every name, shape and
    dtype in the files' headers is the served model's (no value is read). Raises
    WeightsRefused naming every problem (up to SHOWN)."""
    from safetensors import SafetensorError, safe_open
    expected = expected_shapes(served)
    block = families.of(served).block
    embed = block.embed.hf[0]
    handles, where, problems = {}, {}, []
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
            names = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightsRefused(f"unreadable file {f}: {exc}") from None
        handles[f] = handle
        for name in names:
            if name in where:
                problems.append(f"{name}: in both {where[name].name} and {f.name}")
            where[name] = f
    tied = block.lm_head.hf[0] if served.tie_word_embeddings else None
    try:
        parts = fused_parts(where, served)
    except ValueError as exc:   # an expert weight stored both per expert and fused
        raise WeightsRefused(str(exc)) from None
    # A fused expert tensor stands for its per-expert parts (model.experts), with the
    # shape fused_parts gives it.
    fused = {whole: shape for whole, shape, *_ in parts.values()}
    for name in expected:
        if name not in where and name not in parts:
            problems.append(f"missing tensor {name}")
    for name in where:
        if name not in expected and name not in fused and name != tied:
            problems.append(f"extra tensor {name}: the served model has no such weight")
    for name, f in where.items():
        want = expected.get(name) or fused.get(name) or (expected[embed] if name == tied else None)
        if want is None:
            continue
        try:
            meta = handles[f].get_slice(name)
            shape, kind = tuple(meta.get_shape()), meta.get_dtype()
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightsRefused(f"unreadable file {f}: {name}: {exc}") from None
        if shape != tuple(want):
            problems.append(f"{name}: shape {_shape(want)} expected, got {_shape(shape)}")
        if kind not in FLOATING:
            problems.append(f"{name}: dtype {kind} cannot be served as {str(dtype).removeprefix('torch.')} "
                            f"(one of {', '.join(FLOATING)} expected)")
    _refuse(problems)
    return handles, where


def _read_checked(files: list, served: ModelConfig, dtype) -> tuple:
    """(every tensor as stored, by name; the ones the model reads, in `dtype`), each
    checked. Names, shapes and dtypes are checked from the files' headers before
    any value is read."""
    from safetensors import SafetensorError
    handles, where = check_headers(files, served, dtype)
    block = families.of(served).block
    embed = block.embed.hf[0]
    tied = block.lm_head.hf[0] if served.tie_word_embeddings else None
    problems = []
    raw, converted = {}, {}
    for name in sorted(where):
        f = where[name]
        try:
            t = handles[f].get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise WeightsRefused(f"unreadable file {f}: {name}: {exc}") from None
        raw[name] = t
        bad = non_finite(t)
        if bad:
            problems.append(f"{name}: {_values(bad)} NaN or Inf")
            continue
        c = t.to(dtype)
        if c is not t:
            over = non_finite(c)
            if over:
                problems.append(f"{name}: {_values(over)} beyond {str(dtype).removeprefix('torch.')}'s range")
        converted[name] = c
    if tied in converted and not torch.equal(converted[tied], converted[embed]):
        problems.append(tied_differs(served))
    _refuse(problems)
    # Fused expert tensors as their per-expert parts: the names the model reads and the
    # loader fingerprints.
    return per_expert(raw, served), per_expert(converted, served)

