import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run on the CPU through the interpreter (must be set before triton loads).
os.environ.setdefault("TRITON_INTERPRET", "1")

# The files that take the longest (15 s and more on 2 cores), longest first. `make
# test` hands whole files to two processes in collection order (pytest-xdist --dist
# loadfile --no-loadscope-reorder; by default xdist orders files by their count of
# tests, which put the few long tests last), so a long file collected last runs alone
# at the end while the other process idles; run first, the short files fill in
# around them. Only the order of files changes, never the order within one.
LONG_FILES = ("test_triton_reference.py", "test_tensor_parallel_engine.py", "test_fleet_tp.py", "test_verified.py",
              "test_policy.py", "test_golden.py", "test_server.py", "test_tiny_gguf.py", "test_readme_lm_eval.py",
              "test_kquant_serving.py", "test_model_cache.py", "test_shard_read.py", "test_tensor_parallel_moe.py",
              "test_readme_rl.py", "test_olmoe_gguf.py", "test_probe.py", "test_moe_gguf.py", "test_quantized.py",
              "test_smollm_parity.py", "test_prometheus.py", "test_reference.py", "test_bench_serve.py",
              "test_kv_pressure.py", "test_tensor_parallel_weights.py", "test_triton_moe.py", "test_shard_read_moe.py",
              "test_logprobs.py", "test_fleet.py", "test_tensor_parallel_store.py", "test_tls.py", "test_replay.py",
              "test_server_async.py", "test_kquant_kernels.py", "test_cpp_build.py", "test_cpus.py", "test_kernels.py",
              "test_packaging.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))   # stable: in-file order kept


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2 model, loaded once per session: dequantized to bf16 or
    float32 ("bfloat16", "float32"), or as shipped, its Q4_1 weights as stored ("as_stored")."""
    from gateeng.model import loader
    cache = {}

    def get(dtype="bfloat16"):
        if dtype not in cache:
            cache[dtype] = loader.load(None) if dtype == "as_stored" else loader.load(None, dtype, dequantize=True)
        return cache[dtype]
    return get


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """tests/tiny_gguf.py's write_tiny_gguf(qtype, **kwargs), written once per session:
    the same arguments write the same bytes, so test files that ask for the same tiny
    GGUF share one (and its converted model, gguf_in_transformers)."""
    from tests.tiny_gguf import write_tiny_gguf
    where = tmp_path_factory.mktemp("tiny_gguf")
    cache = {}

    def get(qtype, **kwargs):
        key = repr((sorted(qtype.items()) if isinstance(qtype, dict) else qtype, sorted(kwargs.items())))
        if key not in cache:
            cache[key] = write_tiny_gguf(where / f"tiny-{len(cache)}.gguf", qtype, **kwargs)
        return cache[key]
    return get


@pytest.fixture(scope="session")
def gguf_in_transformers():
    """transformers' float32 model of a GGUF file (from_pretrained(gguf_file=...), in eval
    mode), converted once per session per path: its pure-Python read of the 49152-token
    vocabulary takes ~10 s on 2 cores. Callers only read it."""
    import torch
    from transformers import AutoModelForCausalLM
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
        return cache[path]
    return get


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels():
    """Build the fast plan's CPU kernels and the reference's default build once,
    before any test starts a server subprocess whose start-up timeout would otherwise
    include the builds."""
    from gateeng.plans import cpu_ops, reference_ops
    reference_ops.load()
    return cpu_ops.load()


@pytest.fixture(scope="session", autouse=True)
def route_costs_in_tmp(tmp_path_factory):
    """Engines in this process keep their route costs in a folder of this session's own
    (server subprocesses use $GATEENG_CACHE, as a deployment does): a test never
    reads costs an earlier session timed. The processes of one `pytest -n` session
    share it (the folder above each worker's basetemp is the session's), so a model
    and settings both processes serve are timed once; route_costs writes a file whole."""
    from gateeng.engine import route_costs
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "cache"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(route_costs, "cache_root", lambda: folder)
        yield folder
