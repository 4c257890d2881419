"""`gateeng probe`: is a server's output the same whatever else it is serving?

Point it at any OpenAI-compatible endpoint (gateeng, llama.cpp's llama-server,
vLLM, SGLang) or at a gateeng gRPC server. Every prompt is sent in these runs,
in this order, at temperature 0 (or the seed given):

  prefix    the prompt's first request: right after a request that shares its
            first 0, 25, 50 or 75% (by the prompt's characters, cycling over the
            prompts), so that much of it may be cached, and nothing more
  alone     alone again, its whole prompt now cached where the server caches
  c=2..N    in batches of c prompts sent at once: each request shares the server
            with c-1 others (the other prompts are the noise)

A prompt whose runs gave more than one distinct completion is not reproducible
on that server. The report counts distinct completions per prompt, and where
the first divergence from the prefix run falls: at a token index where the
response names its tokens (gateeng's `replay` block), else at a word index.
Extension fields go through to every HTTP request unchanged (`--extra`: our
`determinism`, llama.cpp's `cache_prompt`, ...).
"""
from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from gateeng.tools.prompts import BUILTIN_PROMPTS
from gateeng.serving.http_client import http_json, openai_base

PREFIX_FRACTIONS = (0.0, 0.25, 0.5, 0.75)
# A warm-up request's prompt after the shared part: unrelated to every prompt.
WARM_TAIL = " Unrelated: list the planets of the solar system in order."


def default_prompts(n: int) -> list:
    """n prompts of three questions each: 43-56 tokens for SmolLM2's tokenizer, so
    that a cached prefix of half or more spans whole 16-token KV blocks."""
    qs = BUILTIN_PROMPTS
    return [f"Answer each question in one short sentence.\n1. {qs[i % len(qs)]}\n2. {qs[(i + 7) % len(qs)]}\n"
            f"3. {qs[(i + 13) % len(qs)]}\nAnswers:\n1." for i in range(n)]


@dataclass(frozen=True)
class Output:
    text: str
    token_ids: Optional[tuple]    # where the server names them


@dataclass
class PromptReport:
    prompt: str
    prefix_fraction: float
    runs: dict = field(default_factory=dict)     # run name -> Output
    distinct: int = 0
    first_divergence: Optional[int] = None       # index of the first token (or word) any run differs at
    unit: str = "token"


class OpenAISender:
    """POST /v1/completions (or /v1/chat/completions) with the extension fields."""

    def __init__(self, url: str, max_tokens: int, extra: dict, chat: bool, model: Optional[str],
                 seed: Optional[int], api_key: Optional[str] = None, ca_file: Optional[str] = None):
        self.base, self.api_key, self.ca_file = openai_base(url), api_key, ca_file
        self.name = self.base
        self.model = model or http_json(f"{self.base}/models", timeout=30, api_key=api_key,
                                        ca_file=ca_file)["data"][0]["id"]
        self.max_tokens, self.extra, self.chat, self.seed = max_tokens, extra, chat, seed

    def __call__(self, prompt: str) -> Output:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0 if self.seed is None else 1,
                **({"seed": self.seed} if self.seed is not None else {}), **self.extra}
        if self.chat:
            res = http_json(f"{self.base}/chat/completions",
                            {**body, "messages": [{"role": "user", "content": prompt}]}, api_key=self.api_key,
                            ca_file=self.ca_file)
            text = res["choices"][0]["message"]["content"] or ""
        else:
            res = http_json(f"{self.base}/completions", {**body, "prompt": prompt}, api_key=self.api_key,
                            ca_file=self.ca_file)
            text = res["choices"][0]["text"]
        ids = (res.get("replay") or {}).get("token_ids")
        return Output(text, tuple(ids) if ids is not None else None)


class GrpcSender:
    def __init__(self, address: str, max_tokens: int, verified: bool, chat: bool, seed: Optional[int],
                 api_key: Optional[str] = None, tls: Optional[dict] = None):
        from gateeng.request import DeterminismParams, Mode, SamplingParams
        from gateeng.serving.grpc_client import Client
        self.client, self.name, self.chat = Client(address, api_key=api_key, **(tls or {})), address, chat
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 1.0, seed=seed)
        self.det = DeterminismParams(Mode.VERIFIED if verified else Mode.OFF)

    def __call__(self, prompt: str) -> Output:
        res = self.client.complete(prompt, self.params, self.det, chat=self.chat, timeout=3600)
        return Output(res.text, tuple(res.token_ids))


def _first_divergence(outputs: Sequence[Output]) -> tuple:
    """(index of the first token, or word, where the outputs differ; the unit)."""
    if all(o.token_ids is not None for o in outputs):
        seqs, unit = [o.token_ids for o in outputs], "token"
    else:
        seqs, unit = [tuple(o.text.split()) for o in outputs], "word"
    if len(set(seqs)) == 1:
        return None, unit
    n = min(len(s) for s in seqs)
    return next((i for i in range(n) if len({s[i] for s in seqs}) > 1), n), unit


def probe(prompts: Sequence[str], send: Callable[[str], Output], concurrency: Sequence[int],
          show_progress: bool = True) -> list:
    """Run every prompt through the runs the module docstring lists."""
    from tqdm import tqdm
    reports = [PromptReport(p, PREFIX_FRACTIONS[i % len(PREFIX_FRACTIONS)]) for i, p in enumerate(prompts)]
    levels = sorted({c for c in concurrency if c > 1})
    total = len(prompts) * (2 + len(levels)) + sum(r.prefix_fraction > 0 for r in reports)
    with tqdm(total=total, desc="probe", unit="request", file=sys.stderr, disable=not show_progress or None) as bar:
        def one(prompt):
            out = send(prompt)
            bar.update(1)
            return out
        for r in reports:
            if r.prefix_fraction > 0:
                one(r.prompt[:int(len(r.prompt) * r.prefix_fraction)] + WARM_TAIL)
            r.runs["prefix"] = one(r.prompt)
        for r in reports:
            r.runs["alone"] = one(r.prompt)
        for c in levels:
            with ThreadPoolExecutor(c) as pool:
                for start in range(0, len(reports), c):
                    group = reports[start:start + c]
                    for r, out in zip(group, pool.map(lambda r: one(r.prompt), group)):
                        r.runs[f"c={c}"] = out
    for r in reports:
        outs = list(r.runs.values())
        r.distinct = len({(o.text, o.token_ids) for o in outs})
        r.first_divergence, r.unit = _first_divergence(outs)
    return reports


def by_run(reports: list) -> dict:
    """Per run: how many prompts' completions differ from their prefix run."""
    names = list(reports[0].runs) if reports else []
    return {name: sum(r.runs[name] != r.runs["prefix"] for r in reports) for name in names}


def markdown(reports: list, target: str, extra: dict) -> str:
    runs = by_run(reports)
    unstable = [r for r in reports if r.distinct > 1]
    lines = [f"target: {target}" + (f", extra fields {json.dumps(extra)}" if extra else ""),
             f"prompts with more than one distinct completion: {len(unstable)} of {len(reports)}", "",
             "| run | prompts differing from their prefix run |", "| --- | --- |"]
    lines += [f"| {name} | {n} of {len(reports)} |" for name, n in runs.items() if name != "prefix"]
    lines += ["", "| prompt | cached prefix at its first run | distinct completions | first divergence |",
              "| --- | --- | --- | --- |"]
    for i, r in enumerate(reports):
        where = "-" if r.first_divergence is None else f"{r.unit} {r.first_divergence}"
        lines.append(f"| {i} | {r.prefix_fraction:.0%} | {r.distinct} | {where} |")
    return "\n".join(lines)


def write(reports: list, out: Path, meta: dict) -> tuple:
    """probe.json and probe.png in `out`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    runs = by_run(reports)
    body = {**meta, "prompts_with_several_completions": sum(r.distinct > 1 for r in reports),
            "differing_from_prefix_run": runs,
            "prompts": [{**{k: v for k, v in asdict(r).items() if k != "runs"},
                         "runs": {name: o.text for name, o in r.runs.items()}} for r in reports]}
    js = out / "probe.json"
    js.write_text(json.dumps(body, indent=1) + "\n")
    # Distinct completions per prompt, counting the runs up to each concurrency.
    names = [n for n in runs if n.startswith("c=")]
    xs, mean, worst = [1], [], []
    steps = [["prefix", "alone"]] + [[n] for n in names]
    xs += [int(n[2:]) for n in names]
    seen = [set() for _ in reports]
    for step in steps:
        for s, r in zip(seen, reports):
            s.update((r.runs[n].text, r.runs[n].token_ids) for n in step)
        mean.append(sum(len(s) for s in seen) / max(1, len(seen)))
        worst.append(max((len(s) for s in seen), default=0))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, worst, "o-", label="most distinct (one prompt)")
    ax.plot(xs, mean, "s--", label="mean over prompts")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrency (1: alone, after a prefix run)")
    ax.set_ylabel("distinct completions per prompt, so far")
    ax.set_ylim(bottom=0)
    ax.set_title(meta.get("label") or meta.get("target", ""), fontsize=9)
    ax.legend()
    fig.tight_layout()
    png = out / "probe.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return js, png
