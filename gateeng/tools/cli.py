"""The `gateeng` command line."""
from __future__ import annotations

import argparse
import json
import os
import sys

from gateeng import __version__, heap, logs
from gateeng.config import (DEVICES, DIRECT, DTYPES, GRPC_PORT, HTTP_BODY_SLACK_BYTES, HTTP_PORT,
                            KV_POSITIONS_PER_SEQ, LOCAL_SERVER, PLANS, REQUEST_MODES, ROUTE_POLICIES, EngineConfig, ConnectionLimits, GateBounds, ServerConfig)
from gateeng.config import GrpcLimits, TlsFiles
from gateeng.plans.kernel_names import ISA_ENV, REFERENCE, REFERENCE_ISAS, TORCH_MM
from gateeng.request import Mode, SamplingParams
from gateeng.serving.credentials import ADMIN_TOKEN_ENV as ADMIN_ENV
from gateeng.serving.credentials import API_KEY_ENV, checked, from_env, read_secret_file
from gateeng.serving.credentials import CA_FILE_ENV, CLIENT_CERT_ENV, CLIENT_KEY_ENV
from gateeng.tools import calibrate as cal
from gateeng.tools.prompts import BUILTIN_PROMPTS, read_prompts

DEFAULTS = EngineConfig()
SERVER = ServerConfig()
SAMPLING = SamplingParams()


def _model_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=DEFAULTS.dtype, choices=DTYPES, help="weights and KV dtype")
    p.add_argument("--dequantize", action="store_true", default=DEFAULTS.dequantize,
                   help="serve a GGUF's quantized weights dequantized to --dtype (converted once through "
                        "transformers and cached), not as stored; a float32 model and CUDA always dequantize")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    _model_source_args(p)
    p.add_argument("--device", default=DEFAULTS.device, choices=DEVICES)
    p.add_argument("--plan", default=DEFAULTS.plan, choices=PLANS,
                   help="fast: per-request determinism; invariant: every request on the batch-invariant plan")
    p.add_argument("--margin-threshold", type=float, default=DEFAULTS.margin_threshold,
                   help="verify a VERIFIED request's token when top1-top2 logit margin is below this (tau); "
                        "`gateeng calibrate` measures it for a model")
    p.add_argument("--router-margin-threshold", type=float, default=DEFAULTS.router_margin_threshold,
                   help="a mixture of experts: also verify a VERIFIED token when, in any routing layer, the "
                        "k-th router score is within this of the (k+1)-th (0: exact ties only)")
    p.add_argument("--max-window", type=int, default=DEFAULTS.max_window,
                   help="verify after this many unverified tokens at the latest (W)")
    p.add_argument("--verified-route", choices=ROUTE_POLICIES, default=DEFAULTS.verified_route,
                   help="how VERIFIED requests decode: speculative (fast plan, replayed where the gate "
                        "says), direct (invariant plan), or adaptive (the cheaper of the two per step, "
                        "from measured plan costs); the output is the reference either way")
    p.add_argument("--max-verify-delay", type=int, default=DEFAULTS.max_verify_delay,
                   help="steps a margin-triggered verify replay may wait to share an invariant pass with "
                        "others (speculating meanwhile); window and finish triggers never wait")
    p.add_argument("--kv-blocks", type=int, default=DEFAULTS.num_kv_blocks,
                   help=f"KV cache size in blocks of {DEFAULTS.block_size} positions (0: {KV_POSITIONS_PER_SEQ} "
                        f"positions for each of --max-num-seqs requests, or one --max-model-len request if that "
                        f"is more; the default is {DEFAULTS.max_num_seqs * KV_POSITIONS_PER_SEQ} positions)")
    p.add_argument("--invariant-rows", type=int, default=DEFAULTS.invariant_rows,
                   help="CPU invariant plan: rows per fixed-shape matmul group (oneDNN or torch.mm matmuls, "
                        "and the sampled rows' float32 lm_head), part of the canonical reference; 0 = 32 where "
                        "the CPU has native bf16 matmuls (avx512_bf16, amx_bf16), else 8")
    p.add_argument("--max-model-len", type=int, default=DEFAULTS.max_model_len,
                   help="positions one request may use, prompt and output (0: the model's limit, within "
                        "what --kv-blocks holds)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs,
                   help="requests in the running batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULTS.max_num_batched_tokens,
                   help="positions one engine step may compute (decodes, prefill chunks, verify replays)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULTS.prefill_chunk,
                   help="while requests are decoding, a step prefills at most max(this, number of decoding "
                        "requests) prompt positions: long prompts are chunked and interleaved with the decodes, "
                        "which bounds inter-token latency (0 = no limit beyond --max-num-batched-tokens)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the KV of shared prompt prefixes")
    p.add_argument("--no-packed-weights", action="store_true",
                   help="CPU: the fast plan (and a float32 model's invariant plan) multiplies the plain weights "
                        "instead of packed ones (by default the one packed copy the reference multiplies too, under "
                        "VDPBF16PS on AVX-512 BF16, else the reference's AVX2 matmul; else oneDNN's copy): steps get "
                        "slower, and a bf16 model keeps its plain weights beside the reference's packed copy. A bf16 "
                        f"model's invariant plan is the reference ({REFERENCE}) either way; a float32 model's bits "
                        f"change: kernel_plan says matmul={TORCH_MM}")
    p.add_argument("--no-cpu-kernels", action="store_true",
                   help="CPU: the fast plan (and a float32 model's invariant plan) uses torch ops instead of the "
                        "C++ kernels (norms, RoPE, SiLU, attention over the paged cache, the row-invariant matmul), "
                        "which are otherwise built on first use (needs a C++ compiler; about a minute, cached in "
                        f"$GATEENG_CACHE). A bf16 model's invariant plan is the reference ({REFERENCE}, "
                        f"kernels/SPEC.md) either way, on its own kernels: the best build this CPU runs, or the "
                        f"one ${ISA_ENV}={'|'.join(REFERENCE_ISAS)} names; without a compiler VERIFIED is refused")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads, per rank with --tensor-parallel-size (default: the CPUs this "
                        "process may use, the smaller of its affinity mask and its cgroup CPU quota, rounded "
                        "down, shared out over the ranks; the start-up log says how many and why; at size 1, "
                        "fewer between steps while other processes hold cores)")
    _tensor_parallel_args(p)
    p.add_argument("--tensor-parallel-timeout", type=float, default=DEFAULTS.tensor_parallel_timeout,
                   metavar="SECONDS",
                   help="how long any collective may wait on a rank before the engine fails every request and "
                        "stops (a dead rank is seen at once)")


def _tensor_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=DEFAULTS.tensor_parallel_size, metavar="N",
                   help="split the model over N processes on this machine (a power of two up to 16), started by "
                        "the engine, in one torch.distributed group on gloo; VERIFIED bits are the same at every "
                        "N (bf16 models on CPU only). A model whose MLP or attention output does not split on the "
                        "reference's blocks is refused at start-up, with the reason")


def _admin_token_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--admin-token-file", default=None, metavar="FILE",
                   help=f"{help}: the admin bearer token, read from this file (or from ${ADMIN_ENV}); "
                        "never on the command line, where the process list shows it")


def _admin_token(args):
    """The admin token from --admin-token-file, else $GATEENG_ADMIN_TOKEN, else None."""
    if args.admin_token_file:
        return read_secret_file(args.admin_token_file, "--admin-token-file")
    return from_env(ADMIN_ENV)


def _api_key_args(p: argparse.ArgumentParser, help: str) -> None:
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, metavar="KEY",
                     help=f"{help}. --api-key or --api-key-file wins over ${API_KEY_ENV}, which is read when "
                          "neither is given; the process list shows --api-key, not the file or the variable")
    key.add_argument("--api-key-file", default=None, metavar="FILE",
                     help="--api-key, read from this file (one trailing newline dropped)")


def _api_key(args):
    """--api-key, else --api-key-file, else $GATEENG_API_KEY, else None."""
    if args.api_key is not None:
        return checked(args.api_key, "--api-key")
    if args.api_key_file:
        return read_secret_file(args.api_key_file, "--api-key-file")
    return from_env(API_KEY_ENV)


def _tls_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca-file", default=None, metavar="FILE",
                   help="talk TLS to a server started with --ssl-certfile: the CA certificate (PEM) that signed "
                        f"its certificate (default ${CA_FILE_ENV}; gRPC: without either, plain text; an https:// "
                        "--openai URL: without either, the system's CAs)")
    p.add_argument("--client-cert", default=None, metavar="FILE",
                   help=f"this client's certificate (PEM), for a server started with --ssl-ca-certs "
                        f"(default ${CLIENT_CERT_ENV})")
    p.add_argument("--client-key", default=None, metavar="FILE",
                   help=f"the private key of --client-cert (PEM) (default ${CLIENT_KEY_ENV})")


def _tls_client(args) -> dict:
    """The TLS files our gRPC clients take (Client's ca_file, cert_file, key_file): each
    flag, else its environment variable, else None."""
    return dict(ca_file=args.ca_file or os.environ.get(CA_FILE_ENV) or None,
                cert_file=args.client_cert or os.environ.get(CLIENT_CERT_ENV) or None,
                key_file=args.client_key or os.environ.get(CLIENT_KEY_ENV) or None)


def _server_client(args, target: str, admin: bool = False):
    """A Client for `target` with this command's API key, TLS files and, for admin
    calls, its admin token; ValueError / OSError where one is unreadable or the token
    missing."""
    from gateeng.serving.grpc_client import Client
    token = _admin_token(args) if admin else None
    if admin and not token:
        raise ValueError(f"the admin token is missing: pass --admin-token-file or set ${ADMIN_ENV}")
    return Client(target, admin_token=token, api_key=_api_key(args) or "", **_tls_client(args))


def _rpc_error(e) -> str:
    """A failed call's status and details; where the address answered HTTP/1.1 (the
    OpenAI front's port, not gRPC's), what to give instead."""
    text = f"{e.code().name}: {e.details()}"
    if "http1.x" in (e.details() or ""):
        text += (f" -- that address is an HTTP/1.1 server, such as gateeng's OpenAI front (--http-port, default "
                 f"{HTTP_PORT}); this command speaks gRPC: give the server's gRPC port (--port, default {GRPC_PORT})")
    return text


def _engine_config(args):
    return EngineConfig(model=args.model, dtype=args.dtype, dequantize=args.dequantize, device=args.device,
                        plan=args.plan,
                        margin_threshold=args.margin_threshold, max_window=args.max_window,
                        router_margin_threshold=args.router_margin_threshold,
                        verified_route=args.verified_route, max_verify_delay=args.max_verify_delay,
                        num_kv_blocks=args.kv_blocks, invariant_rows=args.invariant_rows,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        prefill_chunk=args.prefill_chunk, enable_prefix_caching=not args.no_prefix_caching,
                        pack_fast_weights=not args.no_packed_weights, cpu_kernels=not args.no_cpu_kernels,
                        num_threads=args.threads, max_queue=getattr(args, "max_queue", DEFAULTS.max_queue),
                        tensor_parallel_size=args.tensor_parallel_size,
                        tensor_parallel_timeout=args.tensor_parallel_timeout,
                        weight_update_wait=getattr(args, "weight_update_wait", DEFAULTS.weight_update_wait),
                        recalibrate_route=getattr(args, "recalibrate_route", DEFAULTS.recalibrate_route))


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=SAMPLING.max_tokens)
    p.add_argument("--temperature", type=float, default=SAMPLING.temperature, help="0 (or below 1e-5) = greedy")
    p.add_argument("--top-p", type=float, default=SAMPLING.top_p)
    p.add_argument("--top-k", type=int, default=SAMPLING.top_k, help="0 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (temperature > 0; default: a random one, which the result's "
                        "reproducibility record names)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    p.add_argument("--verified", action="store_true", help="ask for a VERIFIED (bitwise reproducible) decode")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="each output token's logprob and its K most likely alternatives (0-20)")
    p.add_argument("--json", action="store_true",
                   help="print the whole response as one line of JSON (a gRPC CompleteResponse: the record, the "
                        "prompt's token ids and the sampling as run), which `gateeng replay` reads")


# generate's engine options that a request to a server carries as its own settings.
REQUEST_GATE_OPTIONS = ("margin_threshold", "max_window")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _generate_options(p: argparse.ArgumentParser) -> None:
    _sampling_args(p)
    _add_model_args(p)
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="send the request to a running `gateeng serve` instead of loading the model here; "
                        f"{' and '.join(_flag(d) for d in REQUEST_GATE_OPTIONS)} then go with the request (within "
                        "the server's bounds), and the options that set up a local engine are refused")


def given_options(generate_argv: list, dests) -> list:
    """The options among `dests` that a generate command line sets. argparse fills in
    a default only where the namespace lacks the attribute, so parsing into one that
    holds a marker for each leaves the marker where the option was not given. (A value
    equal to the default still counts: a server's defaults need not be this command's.)"""
    p = argparse.ArgumentParser(add_help=False)
    _generate_options(p)
    unset = object()
    seen = vars(p.parse_known_args(generate_argv, argparse.Namespace(**dict.fromkeys(dests, unset)))[0])
    return [d for d in dests if seen[d] is not unset]


def engine_options() -> list:
    """The dests of the options that configure an engine (_add_model_args)."""
    p = argparse.ArgumentParser(add_help=False)
    _add_model_args(p)
    return list(vars(p.parse_args([])))


def cmd_generate(args) -> int:
    from gateeng.request import DeterminismParams
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                            logprobs=args.logprobs)
    det = DeterminismParams(mode=Mode.VERIFIED if args.verified else Mode.OFF)
    if getattr(args, "server", None):
        import grpc
        # The server was set up by its own command line: an engine option here would be
        # silently ignored, so it is refused; tau and W are a request's own to ask for.
        argv = args.argv[args.argv.index("generate") + 1:]
        given = given_options(argv, engine_options())
        local = [d for d in given if d not in REQUEST_GATE_OPTIONS]
        if local:
            print(f"error: {', '.join(map(_flag, local))} set up a local engine, and a server runs with its own "
                  f"settings: drop them, or run without --server", file=sys.stderr)
            return 2
        asked = {d: getattr(args, d) for d in REQUEST_GATE_OPTIONS if d in given}
        det = DeterminismParams(det.mode, **asked)
        try:
            client = _server_client(args, args.server)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        with client:
            try:
                res = client.complete(args.prompt, params, det, chat=not args.no_chat)
            except grpc.RpcError as e:
                print(f"error: {_rpc_error(e)}", file=sys.stderr)
                return 2
            print(_json_line(res) if args.json else res.text)
            d = res.determinism
            print(f"[{res.usage.completion_tokens} tokens, mode={d.mode}, triggers="
                  f"{d.triggers_margin + d.triggers_router + d.triggers_window + d.triggers_finish}, "
                  f"mismatches={d.mismatches}]",
                  file=sys.stderr)
            return 0
    from gateeng.engine.engine import Engine
    from gateeng.engine.errors import DeterminismUnavailable, EngineDead
    engine = None
    try:
        engine = Engine(_engine_config(args))
        res = engine.generate(args.prompt, params, det, chat=not args.no_chat)
    except (ValueError, OSError, DeterminismUnavailable) as e:   # OSError: a missing file, a full disk
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineDead as e:   # the engine failed while it ran (a tensor-parallel rank died)
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if engine is not None and engine.failure is not None:
            engine.shutdown()
    if args.json:
        from gateeng.serving.grpc_api import complete_proto
        print(_json_line(complete_proto(res, res.request_id)))
    else:
        print(res.text)
    s = res.stats
    print(f"[{res.completion_tokens} tokens, finish={res.finish_reason.value}, mode={res.mode.value}"
          + (f", triggers={s.triggers}, mismatches={s.mismatches}" if res.mode == Mode.VERIFIED else "")
          + "]", file=sys.stderr)
    engine.shutdown()
    return 0


def _json_line(response) -> str:
    from google.protobuf import json_format
    return json.dumps(json_format.MessageToDict(response, preserving_proto_field_name=True))


def cmd_replay(args) -> int:
    from pathlib import Path

    from gateeng.answers import Answer
    from gateeng.tools import replay as rp
    remote = args.server or args.openai
    if remote and (args.model or args.dtype or args.threads):
        print("error: --model, --dtype and --threads set up a local engine; a server replays on its own: drop "
              "them, or run without --server/--openai", file=sys.stderr)
        return 2
    try:
        items = rp.read(Path(args.file))
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not items:
        print(f"error: {args.file} holds no responses", file=sys.stderr)
        return 2
    try:
        if args.server:
            target = rp.GrpcTarget(args.server, _api_key(args) or "", _tls_client(args))
        elif args.openai:
            target = rp.OpenAITarget(args.openai, _api_key(args), args.ca_file)
        else:
            dtypes = {it.record.get("dtype") for _, it in items if isinstance(it, Answer)}
            dtype = args.dtype or (dtypes.pop() if len(dtypes) == 1 else DEFAULTS.dtype)
            # Direct: every VERIFIED decode on the invariant plan (the same bits; no plan pricing at start-up).
            target = rp.LocalTarget(EngineConfig(model=args.model, dtype=dtype, dequantize=args.dequantize,
                                                 num_threads=args.threads, verified_route=DIRECT))
    except (ValueError, OSError, rp.Unreplayable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        outcomes = rp.run(items, target)
    finally:
        target.close()
    print(rp.summary(outcomes), file=sys.stderr)
    return 0 if all(o.identical for o in outcomes if o.promised) else 1


def cmd_probe(args) -> int:
    from pathlib import Path

    import grpc

    from gateeng.tools import probe as pr
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
        if not levels or min(levels) < 1:
            raise ValueError(f"--concurrency takes counts >= 1, got {args.concurrency!r}")
        extra = json.loads(args.extra) if args.extra else {}
        if not isinstance(extra, dict):
            raise ValueError("--extra must be a JSON object")
        if args.server and (extra or args.model):
            raise ValueError("--extra and --model are HTTP request fields; over gRPC use --verified")
        if args.verified and args.openai:
            extra = {"determinism": {"mode": Mode.VERIFIED.value}, **extra}
        prompts = (read_prompts(Path(args.prompts))[:args.num_prompts] if args.prompts
                   else pr.default_prompts(args.num_prompts))
        if args.server:
            send = pr.GrpcSender(args.server, args.max_tokens, args.verified, args.chat, args.seed,
                                 _api_key(args) or "", _tls_client(args))
        else:
            send = pr.OpenAISender(args.openai, args.max_tokens, extra, args.chat, args.model, args.seed,
                                   _api_key(args), args.ca_file)
        reports = pr.probe(prompts, send, levels)
    except (ValueError, OSError) as e:     # an HTTP error, a refused connection, bad options
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"error: {_rpc_error(e)}", file=sys.stderr)
        return 2
    meta = {"target": send.name, "label": args.label, "extra": extra,
            "mode": (Mode.VERIFIED if args.verified else Mode.OFF).value,
            "chat": args.chat, "max_tokens": args.max_tokens, "seed": args.seed, "concurrency": levels}
    js, png = pr.write(reports, Path(args.out), meta)
    print(pr.markdown(reports, send.name, extra))
    print(f"\nwrote {js} and {png}", file=sys.stderr)
    return 1 if any(r.distinct > 1 for r in reports) else 0


def server_config(args) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port,
                        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                        drain_seconds=args.drain_seconds, max_prompt_bytes=args.max_prompt_bytes,
                        http_port=None if args.http_port < 0 else args.http_port,
                        served_model_name=args.served_model_name,
                        expose_model_path=args.expose_model_path,
                        http_default_mode=args.http_default_mode, freeze_heap=not args.no_heap_freeze,
                        bounds=GateBounds(args.request_tau_max, args.request_window_min, args.request_window_max),
                        http_limits=_limits(args, args.http_max_connections),
                        metrics_limits=_limits(args, args.metrics_max_connections),
                        grpc_limits=GrpcLimits(args.grpc_max_connections, args.grpc_handshake_timeout,
                                               args.grpc_idle_timeout),
                        tls=TlsFiles(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs),
                        metrics_host=args.metrics_host)


def cmd_fleet(args) -> int:
    from gateeng.fleet import serve
    logs.set_level(args.log_level)
    try:
        cfg = _engine_config(args)
        cfg.validate()
        server = serve.fleet_server(cfg, server_config(args), args.replicas, args.ray_address, args.max_restarts,
                                    admin_token=_admin_token(args), api_key=_api_key(args))
        return serve.run(server)
    except (ValueError, OSError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _limits(args, max_connections: int) -> ConnectionLimits:
    return ConnectionLimits(max_connections=max_connections, header_timeout_s=args.http_header_timeout,
                            body_timeout_s=args.http_body_timeout, keep_alive_timeout_s=args.http_keep_alive_timeout)


def cmd_serve(args) -> int:
    import asyncio

    from gateeng.serving.server import Server
    logs.set_level(args.log_level)
    try:
        cfg = _engine_config(args)
        cfg.validate()
        settings = server_config(args)
        server = Server(cfg, settings, admin_token=_admin_token(args), api_key=_api_key(args))
        return asyncio.run(server.run())
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_calibrate(args) -> int:
    from pathlib import Path

    from gateeng.model.chat import encode_prompt
    from gateeng.model.loader import load
    from gateeng.plans import packing
    try:
        texts = read_prompts(Path(args.prompts)) if args.prompts else list(BUILTIN_PROMPTS)
        if args.quick:
            texts, args.tokens, sizes = texts[:8], min(args.tokens, 16), [1, 4]
        else:
            sizes = [int(b) for b in args.batch_sizes.split(",")]
        if not (0 < args.target_miss < 1):
            raise ValueError(f"--target-miss must be in (0, 1), got {args.target_miss}")
        loaded = load(args.model, args.dtype, dequantize=args.dequantize)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = [encode_prompt(loaded.tokenizer, t, chat=not args.no_chat) for t in texts]
    try:
        report = cal.calibrate(loaded, prompts, args.tokens, sizes, args.dtype, args.target_miss,
                               tensor_parallel_size=args.tensor_parallel_size)
    except ValueError as e:   # a size or setting the engine refuses at start-up
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"model": loaded.source, "dtype": args.dtype, "prompts": len(prompts), "tokens": args.tokens,
            "batch_sizes": sizes, "weights": "quantized as stored" if packing.quantized(loaded.model) else args.dtype}
    js, png = cal.write(report, Path(args.out), meta)
    print(cal.markdown(report))
    print(f"\nwrote {js} and {png}", file=sys.stderr)
    if args.apply:
        if report.recommended_tau is None:
            print("error: nothing to apply: no tau met the target", file=sys.stderr)
            return 3
        return _update_gate(args.apply, args, report.recommended_tau, None)
    return 0


def _update_gate(target: str, args, tau, window) -> int:
    import grpc
    setting = tau is not None or window is not None
    try:
        client = _server_client(args, target, admin=setting)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with client as c:
        try:
            cfg = c.update_gate_config(margin_threshold=tau, max_window=window) if setting \
                else c.server_info().gate
        except grpc.RpcError as e:
            print(f"error: {_rpc_error(e)}", file=sys.stderr)
            return 2
    print(f"{target}: margin_threshold (tau) = {cfg.margin_threshold:g}, max_window (W) = {cfg.max_window}")
    return 0


def cmd_admin_gate(args) -> int:
    return _update_gate(args.server, args, args.tau, args.window)


def cmd_update_weights(args) -> int:
    import grpc
    try:
        client = _server_client(args, args.server, admin=True)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with client as c:
        try:
            res = c.update_weights(os.path.abspath(args.dir))
        except grpc.RpcError as e:
            print(f"error: {_rpc_error(e)}", file=sys.stderr)
            return 2
    print(f"{args.server}: weights from {args.dir} in place: weight_version {res.weight_version}, "
          f"model_fingerprint {res.model_fingerprint}, {res.seconds:.2f} s, {res.requests_ended} requests ended")
    return 0


def cmd_model_dir(args) -> int:
    """Print the Hugging Face-format directory of a model (a .gguf is converted once
    and cached): the tokenizer path tools such as lm-eval-harness take."""
    from pathlib import Path

    from gateeng.model.loader import default_model_path, ensure_hf_dir
    try:
        print(ensure_hf_dir(Path(args.model) if args.model else default_model_path()))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_health(args) -> int:
    """Exit 0 when the server's engine is SERVING, 1 otherwise (a container HEALTHCHECK)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gateeng.serving.grpc_client import channel as open_channel
    try:
        channel = open_channel(args.server, **_tls_client(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="gateeng.v1.Engine"), timeout=args.timeout).status
        except grpc.RpcError as e:
            print(f"{args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.server}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """An option's default in its help, except None: there the help text says what
    happens when the option is not given."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Subcommand parsers show each option's default in --help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)


def _serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `gateeng serve`, which `gateeng fleet` takes too."""
    _add_model_args(p)
    p.add_argument("--host", default=SERVER.host, help="address to bind gRPC and HTTP (and metrics, unless "
                                                        "--metrics-host)")
    p.add_argument("--port", type=int, default=SERVER.port, help="gRPC port")
    p.add_argument("--metrics-port", type=int, default=SERVER.metrics_port, help="Prometheus /metrics port (-1: off)")
    p.add_argument("--metrics-host", default=SERVER.metrics_host,
                   help="address to bind --metrics-port, such as a private interface while --host is public "
                        "(default: --host)")
    p.add_argument("--http-port", type=int, default=SERVER.http_port,
                   help="port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /tokenize, /detokenize, /version, /health, /metrics), served beside gRPC "
                        f"(default {SERVER.http_port}; -1: off)")
    p.add_argument("--http-default-mode", choices=REQUEST_MODES, default=SERVER.http_default_mode,
                   help="determinism of HTTP requests that set none: `verified` makes every lm-eval or openai "
                        "client request VERIFIED without an extension field")
    p.add_argument("--http-max-connections", type=int, default=SERVER.http_limits.max_connections,
                   help="HTTP connections open at once; one more is answered 503 and closed")
    p.add_argument("--metrics-max-connections", type=int, default=SERVER.metrics_limits.max_connections,
                   help="/metrics connections open at once; one more is answered 503 and closed")
    p.add_argument("--http-header-timeout", type=float, default=SERVER.http_limits.header_timeout_s,
                   help="seconds a connection (HTTP and metrics) has to send a request's headers, from opening "
                        "(with TLS, the handshake included) or from a kept-alive connection's next request; then "
                        "it is closed")
    p.add_argument("--http-body-timeout", type=float, default=SERVER.http_limits.body_timeout_s,
                   help="seconds an HTTP request has to send its whole body after its headers; then it gets 408")
    p.add_argument("--http-keep-alive-timeout", type=float, default=SERVER.http_limits.keep_alive_timeout_s,
                   help="seconds an idle kept-alive connection stays open")
    p.add_argument("--grpc-max-connections", type=int, default=SERVER.grpc_limits.max_connections,
                   help="gRPC connections open at once; one more closes the oldest that has sent nothing yet, "
                        "else it is closed at once. Each holds 3 open files; where the open-file limit cannot "
                        "hold every listener's limit, all are lowered alike (the start-up log says so)")
    p.add_argument("--grpc-handshake-timeout", type=float, default=SERVER.grpc_limits.handshake_timeout_s,
                   help="seconds a gRPC connection has to send the HTTP/2 preface (with TLS: to finish the "
                        "handshake) and its settings; then it is closed")
    p.add_argument("--grpc-idle-timeout", type=float, default=SERVER.grpc_limits.idle_timeout_s,
                   help="seconds a gRPC connection with no call in flight stays open (clients reconnect on "
                        "their next call)")
    p.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve TLS on both fronts (HTTPS, and gRPC over TLS) with this certificate chain (PEM); "
                        "needs --ssl-keyfile. /metrics on --metrics-port stays plain HTTP")
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the private key of --ssl-certfile (PEM)")
    p.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="require a client certificate signed by one of these CAs (PEM) on both fronts; needs "
                        "--ssl-certfile")
    p.add_argument("--served-model-name", default=SERVER.served_model_name,
                   help="the model's name on both fronts: the id the HTTP API reports and accepts, and "
                        "GetModelInfo's name (default: the model file's or directory's name)")
    p.add_argument("--expose-model-path", action="store_true", default=SERVER.expose_model_path,
                   help="report the model's path on this machine to every client (GetModelInfo.source); by "
                        "default that field is empty and clients see only the model's name and fingerprint")
    p.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue,
                   help="requests allowed to wait; beyond it calls fail with RESOURCE_EXHAUSTED and a retry hint")
    p.add_argument("--max-prompt-bytes", type=int, default=SERVER.max_prompt_bytes,
                   help="largest prompt text accepted on either front, checked before tokenizing; an HTTP "
                        f"body longer than this plus {HTTP_BODY_SLACK_BYTES // 1024} KiB is a 413 (0: 32 bytes "
                        "per context position)")
    p.add_argument("--request-tau-max", type=float, default=SERVER.bounds.max_margin_threshold,
                   help="the largest margin_threshold a request may ask for")
    p.add_argument("--request-window-min", type=int, default=SERVER.bounds.min_window,
                   help="the smallest max_window a request may ask for")
    p.add_argument("--request-window-max", type=int, default=SERVER.bounds.max_window,
                   help="the largest max_window a request may ask for (a verify replay is up to W+1 "
                        "positions in one step)")
    _admin_token_arg(p, "enables admin RPCs (UpdateGateConfig, UpdateWeights)")
    _api_key_args(p, "require this API key on every gRPC Engine call (metadata `authorization: Bearer KEY`) and "
                     "every HTTP path but /health and /metrics (header `Authorization: Bearer KEY`); gRPC health "
                     "and reflection, and --metrics-port, stay open. Not encryption: the key travels in clear "
                     "unless the server has --ssl-certfile (or a TLS proxy fronts it)")
    p.add_argument("--recalibrate-route", action="store_true", default=DEFAULTS.recalibrate_route,
                   help="time both plans' decode passes again at start-up and keep the new costs. The adaptive "
                        "route prices each step from these costs, timed once per machine, kernel build, model and "
                        "settings and kept in $GATEENG_CACHE (the log says where they came from); costs timed on a "
                        "busy machine, or refused, are timed again by the first start that finds it quiet")
    p.add_argument("--weight-update-wait", type=float, default=DEFAULTS.weight_update_wait, metavar="SECONDS",
                   help="a weight update (`gateeng update-weights`) admits no new request and lets the running "
                        "ones finish on the old weights for up to this long; those still running then end with "
                        "finish_reason abort, so no answer mixes two weight versions")
    p.add_argument("--drain-seconds", type=float, default=SERVER.drain_seconds,
                   help="on SIGTERM, how long in-flight requests may finish before they end with UNAVAILABLE")
    p.add_argument("--no-heap-freeze", action="store_true",
                   help="leave the objects alive at start-up (model, tokenizer, libraries) to the garbage "
                        "collector; by default they are frozen once the engine is up, since a full collection "
                        "over them stalls every stream for about 160 ms")
    p.add_argument("--log-level", default=logs.DEFAULT_LEVEL, choices=logs.LEVELS)
    p.add_argument("--version", action="version", version=f"gateeng {__version__}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateeng", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gateeng {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    _generate_options(g)
    _api_key_args(g, "with --server: the server's API key, sent as `authorization: Bearer KEY`")
    _tls_client_args(g)
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="serve the model over gRPC, with Prometheus metrics")
    _serve_args(s)
    s.set_defaults(func=cmd_serve)
    f = sub.add_parser("fleet", help="serve the model from several replicas on a Ray cluster, behind one front",
                       description="Start --replicas engine replicas as Ray actors (one placement-group bundle of "
                                   "--threads CPUs per replica and tensor-parallel rank, spread across the "
                                   "cluster's nodes) behind one gRPC and "
                                   "OpenAI-compatible HTTP front with one /metrics. Requests are routed to the "
                                   "least-loaded replica that holds their prompt prefix; update-weights reaches "
                                   "every replica at once; a replica that dies is restarted by Ray and its "
                                   "VERIFIED requests finish on another replica with the same bits.")
    _serve_args(f)
    f.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster to run on (`ray start --head` prints it; `auto` finds a local one); "
                        "by default a Ray instance is started on this machine")
    f.add_argument("--replicas", type=int, required=True, metavar="N", help="engine replicas to place")
    f.add_argument("--max-restarts", type=int, default=4, metavar="N",
                   help="how many times Ray restarts a replica that dies (-1: always)")
    f.epilog = ("--tensor-parallel-size T: each replica is T ranks on T placement-group bundles (STRICT_SPREAD, "
                "every bundle on its own node, where the cluster has a node for each; else SPREAD), rank 0 the "
                "replica and ranks 1..T-1 Ray actors; every rank reads only its own shard of --model (a Hugging "
                "Face directory or a dense GGUF), and the ranks form one gloo group at rank 0's node address, "
                "signed with the engine's secret. VERIFIED bits are those of one process.")
    f.set_defaults(func=cmd_fleet)
    c = sub.add_parser("calibrate", help="measure where the fast path flips and recommend a margin threshold",
                       description="Decode prompts on the reference and, teacher-forced, on the fast path under "
                                   "several batch sizes; report trigger rate, catch rate and a miss-rate bound "
                                   "per tau; write calibration.json and calibration.png.")
    _model_source_args(c)
    c.add_argument("--prompts", default=None, metavar="FILE",
                   help="text lines, or JSONL with a `prompt` field (default: 32 built-in chat prompts)")
    c.add_argument("--no-chat", action="store_true", help="use the prompts raw, without the chat template")
    c.add_argument("--tokens", type=int, default=cal.TOKENS, help="decode steps per prompt")
    c.add_argument("--batch-sizes", default=",".join(map(str, cal.BATCH_SIZES)),
                   help="batch compositions for the fast path")
    c.add_argument("--target-miss", type=float, default=cal.TARGET_MISS,
                   help=f"recommend the smallest tau whose {cal.CONFIDENCE * 100:g}%% upper bound on missed flips per step "
                        "is below this")
    c.add_argument("--out", default="calibration", help="folder for calibration.json and calibration.png")
    c.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, batch sizes 1 and 4 (a smoke run)")
    _tensor_parallel_args(c)
    c.add_argument("--apply", default=None, metavar="HOST:PORT",
                   help="set the recommended tau on a running server (UpdateGateConfig)")
    _admin_token_arg(c, "for --apply")
    _api_key_args(c, "for --apply: the server's API key, sent as `authorization: Bearer KEY`")
    _tls_client_args(c)
    c.set_defaults(func=cmd_calibrate)
    r = sub.add_parser("replay", help="decode stored responses again and check that VERIFIED ones are bitwise "
                                      "identical",
                       description="Read stored responses (a JSON file, or JSONL of many: gRPC CompleteResponse "
                                   "JSON, `gateeng generate --json` output, or the HTTP front's response body), "
                                   "check each one's Reproducibility record against the target's (another "
                                   "reference, model or dtype is refused before decoding), decode it again as "
                                   "VERIFIED and compare tokens and logprob bits. Exit 0 only if every VERIFIED "
                                   "response is identical; OFF ones are compared but promise nothing.")
    r.add_argument("file", help="the stored response(s)")
    where = r.add_mutually_exclusive_group()
    where.add_argument("--server", default=None, metavar="HOST:PORT",
                       help="replay on a running gateeng server over gRPC (default: a local engine)")
    where.add_argument("--openai", default=None, metavar="URL",
                       help="replay on a running gateeng HTTP front, http://HOST:PORT[/v1]")
    r.add_argument("--model", default=None,
                   help="local engine: HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    r.add_argument("--dtype", default=None, choices=DTYPES,
                   help="local engine: weights and KV dtype (default: the stored records' dtype)")
    r.add_argument("--dequantize", action="store_true",
                   help="local engine: serve a GGUF dequantized, as a server started with --dequantize does")
    r.add_argument("--threads", type=int, default=None, help="local engine: torch CPU threads")
    _api_key_args(r, "with --server or --openai: the server's API key, sent as `Authorization: Bearer KEY`")
    _tls_client_args(r)
    r.set_defaults(func=cmd_replay)
    pb_ = sub.add_parser("probe", help="measure whether a server's completions change with concurrency and "
                                        "caching (exit 1 if any prompt got more than one)",
                         description="Send each prompt after a request sharing part of it, alone, then in batches "
                                     "of 2..N at once (the other prompts are the noise), to any OpenAI-compatible "
                                     "endpoint or a gateeng gRPC server, and count the distinct completions per "
                                     "prompt. Prints a table; writes probe.json and probe.png. Exit 0 only if "
                                     "every prompt got one completion.")
    where = pb_.add_mutually_exclusive_group(required=True)
    where.add_argument("--openai", default=None, metavar="URL", help="an OpenAI-compatible server, "
                                                                     "http://HOST:PORT[/v1]")
    where.add_argument("--server", default=None, metavar="HOST:PORT", help="a gateeng server over gRPC")
    pb_.add_argument("--prompts", default=None, metavar="FILE",
                     help="text lines, or JSONL with a `prompt` field (default: built-in prompts of three "
                          "questions each)")
    pb_.add_argument("--num-prompts", type=int, default=16, help="prompts to probe")
    pb_.add_argument("--concurrency", default="1,2,4,8,16", help="batch sizes to send at once (1: alone)")
    pb_.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    pb_.add_argument("--seed", type=int, default=None,
                     help="sample at temperature 1 with this seed (default: greedy)")
    pb_.add_argument("--chat", action="store_true",
                     help="send each prompt as one user message (/v1/chat/completions; gRPC: the chat template)")
    pb_.add_argument("--verified", action="store_true",
                     help="ask gateeng for VERIFIED: the gRPC mode, or over HTTP the `determinism` field")
    pb_.add_argument("--extra", default=None, metavar="JSON",
                     help="fields merged into every HTTP request body as given, e.g. '{\"cache_prompt\": false}'")
    pb_.add_argument("--model", default=None, help="the HTTP model id (default: the first one /v1/models lists)")
    pb_.add_argument("--label", default=None, help="a title for the plot")
    pb_.add_argument("--out", default="probe", help="folder for probe.json and probe.png")
    _api_key_args(pb_, "the server's API key, sent as `Authorization: Bearer KEY`")
    _tls_client_args(pb_)
    pb_.set_defaults(func=cmd_probe)
    m = sub.add_parser("model-dir", help="print a model's Hugging Face-format directory (config, weights, "
                                          "tokenizer), converting a .gguf once")
    m.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    m.set_defaults(func=cmd_model_dir)
    u = sub.add_parser("update-weights", help="have a running server serve new weights, in place (admin)",
                       description="Send DIR to a running server, which reads it (config.json and *.safetensors "
                                   "under transformers' names; its own tokenizer stays), checks every tensor "
                                   "against the served model and swaps the weights in between two engine steps. "
                                   "Until then no new request joins the batch; running ones finish on the old "
                                   "weights for up to the server's --weight-update-wait seconds, then end with "
                                   "finish_reason abort (\"ended by a weight update\"). Prints the new weight "
                                   "version, model fingerprint and duration. A refused update changes nothing: "
                                   "the server's message is printed and the exit status is 2.")
    u.add_argument("dir", metavar="DIR",
                   help="the checkpoint directory, on the server's machine (a relative path is taken from "
                        "this command's working directory)")
    u.add_argument("--server", default=LOCAL_SERVER, metavar="HOST:PORT", help="the server's gRPC address")
    _admin_token_arg(u, "required")
    _api_key_args(u, "the server's API key where it has one, sent beside the admin token")
    _tls_client_args(u)
    u.set_defaults(func=cmd_update_weights)
    h = sub.add_parser("health", help="check a running server's health (exit 0 only when SERVING)")
    h.add_argument("--server", default=LOCAL_SERVER, metavar="HOST:PORT")
    h.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    _tls_client_args(h)
    h.set_defaults(func=cmd_health)
    a = sub.add_parser("admin", help="operator commands against a running server")
    asub = a.add_subparsers(dest="admin_cmd", required=True, parser_class=_Parser)
    ag = asub.add_parser("gate", help="show or set the server's default gate settings (tau, W)")
    ag.add_argument("--server", default=LOCAL_SERVER, metavar="HOST:PORT")
    ag.add_argument("--tau", type=float, default=None, help="new default margin threshold")
    ag.add_argument("--window", type=int, default=None, help="new default max window")
    _admin_token_arg(ag, "for setting tau or W")
    _api_key_args(ag, "the server's API key where it has one, sent beside the admin token")
    _tls_client_args(ag)
    ag.set_defaults(func=cmd_admin_gate)
    return parser


def main(argv=None) -> int:
    heap.limit_arenas()   # before any command starts its threads (gateeng.heap says why)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
