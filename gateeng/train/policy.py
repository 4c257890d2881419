"""Policy: the trainer's side of a VERIFIED rollout.

A torch.nn.Module whose parameters are float32 master weights, and whose forward is
the reference (kernels/SPEC.md) on their bf16 roundings, as the server rounds them
on loading: `logprobs_from` gives each completion token's log-probability bit for
bit as a VERIFIED answer reports it, on any machine and build the reference runs
on, and `backward()` fills every parameter's `.grad` (train/plan.py says how). So
the policy ratio exp(logp_trainer - logp_rollout) of a VERIFIED rollout is exactly
1 before the first update, and the KL between them exactly 0.

    policy = Policy.load()            # what `gateeng serve --dequantize` serves
    lps = policy.logprobs_from(answers)   # the rollouts as the server answered them
    loss = -(advantage * lps[0]).sum(); loss.backward(); optimizer.step()
    policy.save("ckpt")               # for `gateeng update-weights`

`logprobs_from` reads the ids and the sampling from each answer's own record and
refuses an answer whose bits it cannot reproduce: one that is not VERIFIED, or
whose record names other weights (`fingerprint`) or another arithmetic.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch

# The KV cache's block size of a policy forward: the engine's default. The reference's
# bits do not depend on it (attention runs in chunks of 16 absolute positions whatever
# the cache's blocks).
from gateeng import answers as answer_records, reproducibility
from gateeng.config import BFLOAT16, BLOCK_SIZE, FLOAT32
from gateeng.model import loader
from gateeng.model.fingerprint import model_fingerprint
from gateeng.model.rope import tables
from gateeng.plans import reference_ops
from gateeng.plans.kernel_names import REFERENCE
from gateeng.request import SamplingParams
from gateeng.train.kernels import CpuReference, TritonReference
from gateeng.train.plan import TrainingPlan, TrainKV, spans_meta, token_logprobs

# Tokenizer and config files copied beside saved weights, so a saved policy serves as is.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")


class Policy(torch.nn.Module):
    """The model as float32 master weights (`self.model`, the same LlamaModel the
    server runs, its parameters trainable) with the reference's forward."""

    def __init__(self, loaded: loader.LoadedModel, hf_dir: Optional[Path] = None, isa: Optional[str] = None,
                 kernels: Optional[str] = None):
        super().__init__()
        if loaded.model.dtype != torch.float32:
            raise ValueError("a Policy holds float32 master weights: load the model with dtype float32")
        self.model = loaded.model
        for p in self.model.parameters():
            p.requires_grad_(True)
        # The server's RoPE tables are its bf16 model's: computed in binary64 and rounded
        # once to bf16 (model/rope.py), not rounded from the float32 tables.
        self.model.cos, self.model.sin = tables(loaded.config, torch.bfloat16)
        self.config, self.tokenizer, self.source = loaded.config, loaded.tokenizer, loaded.source
        self.hf_dir = hf_dir
        if kernels not in (None, "cpu", "triton"):
            raise ValueError(f"kernels must be cpu or triton, got {kernels!r}")
        self._kernels_asked = kernels
        try:
            # A CPU build: the forward's kernels on the CPU, and on any device the token
            # choice's arithmetic (scores, log_softmax), as the server's sampler runs it.
            self.ops = reference_ops.load(isa)
        except reference_ops.ReferenceUnavailable as exc:
            raise RuntimeError(f"the policy computes the reference, and no build of it runs here: {exc}") from None
        self._cpu = CpuReference(self.ops)
        self._triton = None
        # The bf16 roundings' fingerprint, kept with the parameters' stamp it was taken at.
        self._roundings: tuple = (None, "")
        # The checkpoint these weights were read from (or last saved to) names them as
        # the server does: (the bf16 roundings' fingerprint, the checkpoint's).
        self._named = (self._roundings_fingerprint(), loaded.fingerprint)

    @classmethod
    def load(cls, path: Optional[str] = None, isa: Optional[str] = None, kernels: Optional[str] = None) -> "Policy":
        """What `gateeng serve --model path --dequantize` serves (the embedded model when
        None): a Hugging Face directory or a GGUF file, a GGUF's quantized weights
        dequantized (a server that keeps them as stored computes other weights, and
        says `trainable: false`). `isa` forces a CPU build of the
        reference (avx512_bf16, avx2, scalar; default: GATEENG_CPU_ISA, else the best
        here). `kernels`: "cpu" or "triton" (the reference's Triton kernels); by
        default the CPU build on the CPU and Triton on CUDA (`policy.cuda()`)."""
        loaded = loader.load(path, dtype=FLOAT32)
        hf_dir = loader.ensure_hf_dir(Path(path) if path else loader.default_model_path())
        return cls(loaded, hf_dir, isa, kernels)

    @property
    def fingerprint(self) -> str:
        """The model fingerprint of the weights the forward computes, by the server's
        definition (gateeng.model.fingerprint): what `gateeng serve` reports for the
        checkpoint this policy was loaded from, while the weights are those; after
        they change (an optimizer step), what a server reports once `save()`'s
        checkpoint is pushed with `gateeng update-weights` or served. Hashed again
        (about a second per GB of bf16 weights) only after a parameter changed in
        place, as an optimizer step changes it."""
        now = self._roundings_fingerprint()
        return self._named[1] if now == self._named[0] else now

    def _roundings_fingerprint(self) -> str:
        """The fingerprint of the bf16 checkpoint save() writes, hashed again only when
        the parameters' stamp (each one's storage and in-place version) has moved."""
        stamp = self._stamp()
        if self._roundings[0] != stamp:
            self._roundings = (stamp, model_fingerprint(self.config, self._checkpoint(torch.bfloat16)))
        return self._roundings[1]

    def _stamp(self) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in self.model.parameters())

    def _checkpoint(self, dtype: torch.dtype) -> dict:
        return {name: t.detach().to(dtype).contiguous() for name, t in self.model.hf_state_dict().items()}

    @property
    def isa(self) -> str:
        """The CPU build this policy computes on (information: every build gives the same bits)."""
        return getattr(self.ops, "isa", "?")

    def kernels(self):
        """The reference's kernels for the parameters' device (train/kernels.py)."""
        device = self.model.embed.device.type
        use = self._kernels_asked or ("triton" if device == "cuda" else "cpu")
        if use == "cpu":
            if device != "cpu":
                raise RuntimeError(f"the CPU build of the reference runs on CPU tensors; the policy is on {device}: "
                                   f"use kernels='triton'")
            return self._cpu
        if self._triton is None:
            self._triton = TritonReference()
        return self._triton

    def logprobs_from(self, answers) -> list:
        """Each completion token's log-probability of VERIFIED rollouts, one float32
        tensor per choice, in order, bit-equal to the logprobs the server reported.
        `answers`: the server's answers as they came back (gateeng.answers: an HTTP
        completion or chat body, an openai client object, a gRPC CompleteResponse, or
        a list of them or of their choices); each choice's prompt and output ids and
        its sampling are read from its own record. Refused (ValueError, naming the
        answer and why) unless every answer is VERIFIED (or REFERENCE) and its record
        names the weights and the arithmetic this policy computes: the written
        reference in bf16, with the policy's `fingerprint`. Differentiable, as
        `logprobs`. A choice with no output tokens gets an empty tensor."""
        try:
            items = answer_records.read_all(answers)
        except answer_records.BadAnswer as e:
            raise ValueError(f"cannot read the rollouts: {e}") from None
        fingerprint = self.fingerprint
        for a in items:
            if not a.promised:
                served = a.mode.upper() if a.mode else "with no determinism mode"
                raise ValueError(f"{a.label} was served {served}, not VERIFIED: its bits are the fast path's, "
                                 f"which no trainer reproduces; sample rollouts with the determinism field "
                                 f'{{"mode": "verified"}} (gRPC: MODE_VERIFIED)')
            self._check_record(a.record, fingerprint, a.label)
        out: list = [None] * len(items)
        groups: dict = {}    # one forward per sampling that decides the logprobs
        for i, a in enumerate(items):
            if a.output_ids:
                s = a.sampling
                groups.setdefault((s.greedy, s.temperature, s.top_p, s.top_k), []).append(i)
            else:
                out[i] = torch.zeros(0, dtype=torch.float32, device=self.model.embed.device)
        for idx in groups.values():
            s = items[idx[0]].sampling
            lps = self._logprobs([items[i].prompt_ids + items[i].output_ids for i in idx],
                                 [len(items[i].prompt_ids) for i in idx], s.temperature, s.top_p, s.top_k)
            for i, lp in zip(idx, lps):
                out[i] = lp
        return out

    def logprobs(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, model_fingerprint: Optional[str] = None) -> list:
        """Each completion token's log-probability, one float32 tensor per sequence
        (prompt then completion; `prompt_lens` their prompt lengths), bit-equal to a
        VERIFIED request's logprobs for the same tokens and sampling: log_softmax of
        logits / temperature over what top_k and top_p keep. A greedy rollout's
        (temperature below request.GREEDY_TEMPERATURE, 0 included) are the
        temperature 1, untruncated ones, as the server reports them. The sampling is
        the caller's to give: a rollout sampled at another temperature gets other
        numbers, silently (`logprobs_from` reads it from the answers instead).
        `model_fingerprint`: the rollouts' record's, refused (ValueError) unless it
        is this policy's `fingerprint`. All sequences run in one forward, each row
        on its own keys, so packing changes no bit. Differentiable: backward() fills
        .grad of the parameters."""
        if model_fingerprint is not None:
            self._check_record({"reference": REFERENCE, "dtype": BFLOAT16, "model_fingerprint": model_fingerprint},
                               self.fingerprint, "the rollouts")
        return self._logprobs(sequences, prompt_lens, temperature, top_p, top_k)

    def _check_record(self, record: dict, fingerprint: str, label: str) -> None:
        """Refuse rollouts whose record names another arithmetic than the written
        reference in bf16, or other weights than this policy's."""
        theirs = record.get("model_fingerprint")
        why = reproducibility.untrainable(record)
        if not why and theirs == fingerprint:
            return
        raise ValueError(
            f"{label} come from other weights or arithmetic than the policy computes: the server's "
            f"model_fingerprint {theirs}, the policy's {fingerprint}; "
            + (why or "likely causes: the server serves another checkpoint than the policy loaded; the policy's "
                      "last update was not pushed (policy.save(dir), then gateeng update-weights --server "
                      "HOST:GRPC_PORT dir); or the server was updated past the policy"))

    def _logprobs(self, sequences, prompt_lens, temperature: float, top_p: float, top_k: int) -> list:
        kernels = self.kernels()
        device = self.model.embed.device
        seqs = [list(map(int, s)) for s in sequences]
        lens = [int(n) for n in prompt_lens]
        self._check(seqs, lens, temperature, top_p, top_k)
        # The server's rule (request.SamplingParams.greedy); T == 1 untruncated gives the same bits either way.
        greedy = SamplingParams(temperature=temperature).greedy or (temperature == 1.0 and top_p == 1.0
                                                                    and top_k == 0)
        positions, slots, meta, blocks = spans_meta([len(s) for s in seqs], BLOCK_SIZE)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=device)
        meta.tables, meta.key_counts = meta.tables.to(device), meta.key_counts.to(device)
        plan = TrainingPlan(self.model, kernels)
        kv = TrainKV(self.config, blocks, BLOCK_SIZE, device)
        hidden = self.model(ids, torch.tensor(positions, device=device), torch.tensor(slots, device=device), meta, kv,
                            plan)
        # Row p predicts token p + 1: a completion's tokens come from rows prompt_len-1 .. len-2.
        rows, targets, sizes = [], [], []
        for (start, _), s, n in zip(meta.spans, seqs, lens):
            rows.extend(range(start + n - 1, start + len(s) - 1))
            targets.extend(s[n:])
            sizes.append(len(s) - n)
        logits = plan.logits(hidden[torch.tensor(rows, dtype=torch.int64, device=device)])
        out = token_logprobs(logits, torch.tensor(targets, dtype=torch.int64), self.ops,
                             float(temperature) if not greedy else 1.0, int(top_k), float(top_p), greedy)
        return list(out.split(sizes))

    def _check(self, seqs: list, lens: list, temperature: float, top_p: float, top_k: int) -> None:
        if len(seqs) != len(lens) or not seqs:
            raise ValueError(f"{len(seqs)} sequences and {len(lens)} prompt lengths: give one length per sequence")
        vocab, limit = self.config.vocab_size, self.config.max_position
        for i, (s, n) in enumerate(zip(seqs, lens)):
            if not 1 <= n < len(s):
                raise ValueError(f"sequence {i}: prompt length {n} must be at least 1 and leave a completion "
                                 f"(the sequence has {len(s)} tokens)")
            if len(s) > limit:
                raise ValueError(f"sequence {i}: {len(s)} tokens, past the model's {limit} positions")
            if min(s) < 0 or max(s) >= vocab:
                raise ValueError(f"sequence {i}: token ids must be in [0, {vocab})")
            window = self.config.sliding_window
            if window is not None and len(s) > window:
                raise ValueError(f"sequence {i}: {len(s)} tokens, past the model's sliding window ({window}); "
                                 f"the reference attends every earlier position")
        if not (temperature == 0 or 0 < temperature < float("inf")):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number > 0, got {temperature}")
        if not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"need 0 < top_p <= 1 and top_k >= 0, got top_p {top_p}, top_k {top_k}")

    def save(self, directory: str, dtype: torch.dtype = torch.bfloat16) -> Path:
        """HF-named safetensors of the weights as the forward uses them (bf16 roundings
        of the masters; `dtype=torch.float32` keeps the masters, which the server rounds
        to the same bf16), with config.json and the tokenizer's files, so that
        `gateeng serve --model directory` and `gateeng update-weights` load it and
        give this policy's bits."""
        from safetensors.torch import save_file
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = self._checkpoint(dtype)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        # The saved checkpoint names these weights from now on (a float32 one hashes its own bytes).
        written = model_fingerprint(self.config, tensors)
        if dtype == torch.bfloat16:   # the file holds the roundings themselves
            self._roundings = (self._stamp(), written)
        self._named = (self._roundings_fingerprint(), written)
        if self.hf_dir is not None:
            config = json.loads((self.hf_dir / "config.json").read_text())
            config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
            (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            for name in TOKENIZER_FILES:
                if (self.hf_dir / name).is_file():
                    shutil.copyfile(self.hf_dir / name, out / name)
        return out

