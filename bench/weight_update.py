"""Weights in place on the embedded model: how long Engine.update_weights takes
against what the engine spends packing the weights at start-up.

The embedded SmolLM2-135M is saved once as a bf16 Hugging Face directory (its
cached float32 conversion rounded to bf16) and a second one with every weight
nudged (another fingerprint). An engine starts on the first; each round times
plans.factory.build on a freshly loaded copy (the start-up packing, as EngineCore
runs it) and then one idle update to the other directory (read, check and
fingerprint, build and pack, swap), alternating the two directories, then the
update's parts one after another. The numbers are medians (and the fastest) over
the rounds; the engine's log line of each update gives its parts too. On a shared
machine, other processes' load swings both numbers by up to 50x (OpenMP waits for
its descheduled workers); --threads 1 is steadier there.

With --under-load N (a second phase), N OFF streams decode back to back on the
engine while one update runs: their tokens/s in the seconds before the update, while
it is prepared and swapped, and after it, and the longest gap between two decode
steps' tokens (the update's pause: running requests finish on the old weights, then
the swap).

Usage: python bench/weight_update.py [--rounds 5] [--threads N] [--under-load 8]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))


def save_bf16_dirs(root: Path) -> tuple:
    """(the embedded model as a bf16 HF directory, the same with every weight nudged)."""
    from safetensors.torch import load_file, save_file

    from gateeng.model.loader import default_model_path, ensure_hf_dir
    src = ensure_hf_dir(default_model_path())
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()})
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = "bfloat16"
    out = []
    for name, scale in (("a", 0.0), ("b", 1e-3)):
        d = root / name
        d.mkdir()
        gen = torch.Generator().manual_seed(1)
        nudged = {k: (v.float() + scale * torch.randn(v.shape, generator=gen)).to(torch.bfloat16) if scale else v
                  for k, v in tensors.items()}
        save_file(nudged, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for tok in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (src / tok).is_file() and name == "a":
                shutil.copy(src / tok, d / tok)   # the start reads a tokenizer; an update needs none
        out.append(d)
    return tuple(out)


def update_parts(cfg, served, path: Path) -> dict:
    """An update's parts timed one after another (in an update the fingerprint is
    hashed on its own thread while the model is built and packed)."""
    from gateeng.engine import weights
    from gateeng.model.fingerprint import model_fingerprint
    from gateeng.model.llama import LlamaModel
    from gateeng.model.loader import DTYPES, weight_files
    from gateeng.plans import factory
    dtype = DTYPES[cfg.dtype]
    out = {}
    t = time.perf_counter()
    raw, converted = weights._read_checked(weight_files(path), served, dtype)
    out["read and check"] = time.perf_counter() - t
    t = time.perf_counter()
    model_fingerprint(served, raw)
    out["fingerprint"] = time.perf_counter() - t
    t = time.perf_counter()
    model = LlamaModel(served, dtype, cfg.device)
    model.load_hf_state_dict(converted)
    out["model from the tensors"] = time.perf_counter() - t
    del raw, converted
    t = time.perf_counter()
    factory.build(cfg, model, served, dtype, owned=True).release_threads()
    out["plans.factory.build (packing)"] = time.perf_counter() - t
    return out


def under_load(engine, path: Path, streams: int, seconds: float = 10.0) -> dict:
    """OFF throughput before, during and after one update, with `streams` clients."""
    import threading

    from gateeng.outputs import Chunk, Completion
    from gateeng.request import SamplingParams
    events, stop = [], threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            done = threading.Event()

            def sink(ev):
                if isinstance(ev, Chunk) and ev.token_ids:
                    events.append((time.perf_counter(), len(ev.token_ids)))
                elif isinstance(ev, Completion):
                    done.set()
            engine.submit(f"Tell me a story about the number {i}.", SamplingParams(max_tokens=48, ignore_eos=True,
                                                                                   temperature=0.8), sink=sink)
            done.wait()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(2.0)                               # warm-up
    t0 = time.perf_counter()
    time.sleep(seconds)
    t1 = time.perf_counter()
    result = engine.update_weights(path)
    t2 = time.perf_counter()
    time.sleep(seconds)
    t3 = time.perf_counter()
    stop.set()
    for t in threads:
        t.join(60)

    def rate(a: float, b: float) -> float:
        return sum(n for t, n in events if a <= t < b) / (b - a)
    stamps = sorted(t for t, _ in events if t1 - 1 <= t <= t2 + 1)
    gap = max((b - a for a, b in zip(stamps, stamps[1:])), default=0.0)
    return {"streams": streams, "before_tok_s": rate(t0, t1), "during_tok_s": rate(t1, t2),
            "after_tok_s": rate(t2, t3), "update_s": result.seconds, "requests_ended": result.requests_ended,
            "longest_gap_s": gap}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--under-load", type=int, default=0, metavar="N",
                    help="also time one update while N OFF streams decode (0: skip)")
    args = ap.parse_args()

    from gateeng.config import EngineConfig
    from gateeng.engine.engine import Engine
    from gateeng.model.loader import DTYPES, load
    from gateeng.plans import factory

    with tempfile.TemporaryDirectory() as tmp:
        a, b = save_bf16_dirs(Path(tmp))
        cfg = EngineConfig(model=str(a), num_threads=args.threads, verified_route="direct")   # no start-up pricing
        engine = Engine(cfg)
        packs, updates, parts = [], [], []
        for i in range(args.rounds):
            loaded = load(str(a), cfg.dtype)
            t0 = time.perf_counter()
            plans = factory.build(cfg, loaded.model, loaded.config, DTYPES[cfg.dtype], owned=True)
            packs.append(time.perf_counter() - t0)
            plans.release_threads()
            del plans, loaded
            result = engine.update_weights(b if i % 2 == 0 else a)
            updates.append(result.seconds)
            parts.append(update_parts(cfg, engine.model_config, b))
        loaded_run = under_load(engine, b if args.rounds % 2 == 0 else a, args.under_load) if args.under_load else None
        engine.shutdown()
    for name in parts[0]:
        print(f"  {name}: median {statistics.median(p[name] for p in parts):.3f} s (one after another, no overlap)")
    pack, update = statistics.median(packs), statistics.median(updates)
    print(f"start-up packing (plans.factory.build): median {pack:.3f} s, fastest {min(packs):.3f} s over "
          f"{len(packs)} ({', '.join(f'{s:.3f}' for s in packs)})")
    print(f"update_weights, idle engine:          median {update:.3f} s, fastest {min(updates):.3f} s over "
          f"{len(updates)} ({', '.join(f'{s:.3f}' for s in updates)}); {update / pack:.2f}x packing "
          f"(fastest: {min(updates) / min(packs):.2f}x)")
    if loaded_run:
        r = loaded_run
        print(f"under load ({r['streams']} OFF streams): {r['before_tok_s']:.1f} tok/s before, {r['during_tok_s']:.1f} "
              f"while the update ran ({r['update_s']:.2f} s, {r['requests_ended']} requests ended), "
              f"{r['after_tok_s']:.1f} after ({r['after_tok_s'] / r['before_tok_s']:.2f}x before); longest gap "
              f"between tokens {r['longest_gap_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
