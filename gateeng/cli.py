"""The `gateeng` command line."""
from __future__ import annotations

import argparse
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and KV dtype")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--plan", default="fast", choices=["fast", "invariant"],
                   help="fast: per-request determinism; invariant: every request on the batch-invariant plan")
    p.add_argument("--margin-threshold", type=float, default=0.1,
                   help="verify a VERIFIED request's token when top1-top2 logit margin is below this (tau)")
    p.add_argument("--max-window", type=int, default=32,
                   help="verify after this many unverified tokens at the latest (W)")
    p.add_argument("--kv-blocks", type=int, default=1024, help="KV cache size in blocks of 16 tokens")
    p.add_argument("--invariant-rows", type=int, default=8,
                   help="CPU invariant plan: rows per fixed-shape group (part of the canonical reference)")


def _engine_config(args):
    from gateeng.config import EngineConfig
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, plan=args.plan,
                        margin_threshold=args.margin_threshold, max_window=args.max_window,
                        num_kv_blocks=args.kv_blocks, invariant_rows=args.invariant_rows)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (or below 1e-5) = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (temperature > 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    p.add_argument("--verified", action="store_true", help="ask for a VERIFIED (bitwise reproducible) decode")


def cmd_generate(args) -> int:
    from gateeng.request import DeterminismParams, Mode, SamplingParams
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))
    det = DeterminismParams(mode=Mode.VERIFIED if args.verified else Mode.OFF)
    if getattr(args, "server", None):
        from gateeng.client import Client
        import grpc
        with Client(args.server) as client:
            try:
                res = client.complete(args.prompt, params, det, chat=not args.no_chat)
            except grpc.RpcError as e:
                print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
                return 2
            print(res.text)
            d = res.determinism
            print(f"[{res.usage.completion_tokens} tokens, mode={d.mode}, triggers="
                  f"{d.triggers_margin + d.triggers_window + d.triggers_finish}, rollbacks={d.rollbacks}]",
                  file=sys.stderr)
            return 0
    from gateeng.engine import DeterminismUnavailable, Engine
    try:
        engine = Engine(_engine_config(args))
        res = engine.generate(args.prompt, params, det, chat=not args.no_chat)
    except (ValueError, FileNotFoundError, DeterminismUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(res.text)
    s = res.stats
    print(f"[{res.completion_tokens} tokens, finish={res.finish_reason.value}, mode={res.mode.value}"
          + (f", triggers={s.triggers}, rollbacks={s.mismatches}" if res.mode.value == "verified" else "")
          + "]", file=sys.stderr)
    engine.shutdown()
    return 0


def cmd_serve(args) -> int:
    import logging
    from gateeng.server import Server
    logging.basicConfig(level=logging.INFO, format="[gateeng] %(message)s")
    cfg = _engine_config(args)
    cfg.max_queue = args.max_queue
    try:
        cfg.validate()
        server = Server(cfg, host=args.host, port=args.port,
                        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                        admin_token=args.admin_token or None)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server.serve_forever(drain_seconds=args.drain_seconds)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gateeng", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    _sampling_args(g)
    _add_model_args(g)
    g.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="send the request to a running `gateeng serve` instead of loading the model here")
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="serve the model over gRPC, with Prometheus metrics")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (gRPC and metrics)")
    s.add_argument("--port", type=int, default=50051, help="gRPC port")
    s.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (-1: off)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait; beyond it calls fail with RESOURCE_EXHAUSTED")
    s.add_argument("--admin-token", default=None,
                   help="enables admin RPCs (UpdateGateConfig) for callers sending this bearer token")
    s.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may finish before they are aborted")
    s.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
