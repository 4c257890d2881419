"""Tensor parallelism's processes: the engine's process is rank 0, the driver, and
runs its own shard; ranks 1..N-1 are worker processes that torch.multiprocessing
starts, each running its shard for every call the driver announces. All N join
one torch.distributed group (gloo on CPU) whose timeout bounds every collective.

The scheduler, the verification stage, the token choice and the outputs stay in
the driver. What crosses the group: each forward's Rows and each logits call's
hidden states (broadcast_object_list from rank 0), the row-parallel sums and the
vocabulary-parallel logits (plans.collectives). Nothing else: no home-made
transport.

Start-up: the driver loads the reference's kernels first (compiled once, where they
were not yet; it refuses here if they cannot be), then shards the model
(model.shard), hands each worker its shard's tensors through shared memory and lets
them go, and builds its own shard and plans last. A model the engine loaded itself
is split one weight at a time for every rank, each weight let go once split, so the
model and its shards are never held twice over; a model handed to the engine stays
whole, and the workers' shards are made one at a time beside it. A worker builds its
plans and KV cache (waiting for a kernel build another process runs), reports on the
group's TCPStore that it is up, and joins the group.

Across nodes (start_ranks): ranks 1..N-1 are started by the caller's `ranks`
(fleet.ranks: Ray actors), and every rank, rank 0 too, reads its own shard by byte
ranges (model.shard_read); the store and gloo listen on rank 0's node address, with
the same signed store and handshake as below.

Loopback and the secret: with LocalRanks every rank is a process on this machine, so
the store and gloo listen on 127.0.0.1 only. The store is open to any local process, so the
driver makes a random secret per engine and hands it to the workers in their spawn
arguments (a pickle over a pipe to the child: not on a command line or in an
environment). Every value the ranks exchange through the store carries an HMAC
under it (SignedStore), so a stranger cannot mark a rank up or rewrite a rank's
gloo address; once gloo has connected, every pair of ranks proves the secret to
each other over its own connection (handshake), so a stranger that took a rank's
place on a gloo listener makes start-up fail before any row is sent.

Weights in place: a worker builds its shard of a new checkpoint on a thread of its
own while it serves (PREPARE), reports whether it is ready (STATUS), and swaps it in
(COMMIT) or drops it (DISCARD) as the driver says (engine.tp_weights).

Fail closed: a worker that exits is seen at once through its process sentinel
(`on_death` callbacks: the engine then fails every request); one that hangs makes
the next collective time out; a collective that fails raises
TensorParallelFailure. While the driver is idle it sends a heartbeat every third
of the timeout, so a worker waiting for its next call never times out, and a
worker whose driver died or hung leaves within one timeout.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import multiprocessing.connection
import os
import secrets
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
import torch.multiprocessing as mp

from gateeng import cpus
from gateeng.config import BFLOAT16, EngineConfig, kv_blocks
from gateeng.engine import tp_weights
from gateeng.heap import trim_heap
from gateeng.logs import log
from gateeng.model import shard, shard_read
from gateeng.model.llama import KVCache
from gateeng.model.loader import DTYPES
from gateeng.plans import packing, reference_ops, sharded
from gateeng.plans.cpu_linear import is_packed
from gateeng.step import PlanKind

HOST = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"   # Linux's loopback interface: its address is 127.0.0.1
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
STARTUP_SECONDS = 300   # for every worker to import, build its plans and report (a cold start compiles)
PING, STOP = "ping", "stop"
# A weight update's two phases (engine.tp_weights): build the new shard aside, report
# its state (all_gather_object), then swap it in everywhere or drop it everywhere.
PREPARE, STATUS, COMMIT, DISCARD = "prepare", "status", "commit", "discard"
STATUS_POLL_S = 0.05   # how often the driver asks the ranks whether their new shards are built


class TensorParallelFailure(RuntimeError):
    """A rank died, hung past the group's timeout, or a collective failed."""


class ForgedValue(TensorParallelFailure):
    """A value on the rendezvous store, or a rank's proof, that was not made with the
    engine's secret: something other than the engine's own ranks wrote it."""


def _mac(secret: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 under the secret over the parts, each length-prefixed (so no two
    different lists of parts give the same message)."""
    message = b"".join(struct.pack("<Q", len(part)) + part for part in parts)
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


class SignedStore(dist.Store):
    """The ranks' view of the rendezvous TCPStore. Every value set through it is
    stored behind an HMAC of (key, value) under the engine's secret, and every value
    read through it must carry the right one, else ForgedValue: a connection without
    the secret can read and overwrite the store, but cannot make a value a rank
    accepts, nor move one rank's value to another key. gloo's rendezvous and the
    ranks' readiness marks use only set, get, wait and check; counters (add) cannot
    carry a MAC and pass through unsigned, and nothing here relies on them."""

    def __init__(self, store: dist.Store, secret: str):
        super().__init__()
        self._store, self._secret = store, secret

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._store.set(key, _mac(self._secret, key.encode(), value) + value)

    def get(self, key: str) -> bytes:
        raw = self._store.get(key)
        tag, value = raw[:32], raw[32:]
        if len(raw) < 32 or not hmac.compare_digest(tag, _mac(self._secret, key.encode(), value)):
            raise ForgedValue(f"the tensor-parallel store's key {key!r} holds a value not made with this "
                              "engine's secret: another process on this machine wrote to the store")
        return value

    def multi_get(self, keys: list) -> list:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list, values: list) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def wait(self, keys: list, timeout: Optional[timedelta] = None) -> None:
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def check(self, keys: list) -> bool:
        return self._store.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)


def _listener(host: str) -> int:
    """A listening socket on `host` (the ranks' address: 127.0.0.1 on one machine) at a
    free port, as a file descriptor for the TCPStore to own (it closes it when it goes).
    TCPStore's own listener binds to every interface (`::`) whatever host it is given,
    with and without libuv; one it is handed (master_listen_fd) keeps its address."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


@contextlib.contextmanager
def _gloo_on(interface: str):
    """While the group is made: gloo binds each rank's listening socket to the
    address of GLOO_SOCKET_IFNAME's interface where that is set, else to the address
    the machine's hostname resolves to (often its LAN address). The ranks' own
    interface (loopback where they are all on this machine) is always right, whatever
    the environment says."""
    before = os.environ.get(GLOO_IFNAME)
    os.environ[GLOO_IFNAME] = interface
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GLOO_IFNAME, None)
        else:
            os.environ[GLOO_IFNAME] = before


def _proof(secret: str, src: int, dst: int) -> bytes:
    return _mac(secret, b"gateeng tensor-parallel rank proof", str(src).encode(), str(dst).encode())


def handshake(rank: int, size: int, secret: str) -> None:
    """Every ordered pair of ranks (src, dst) sends its proof over the pair's own gloo
    connection, and dst checks it, else ForgedValue (a wrong proof) or gloo's timeout
    (none comes). gloo's addresses are signed, so a stranger can be in a pair only by
    connecting to a rank's listener before the rank it stands for; it then talks to
    that one rank only, which sends it no proof it could use elsewhere (each names its
    source and destination), so it cannot show the proof that rank waits for."""
    mine = {peer: torch.frombuffer(bytearray(_proof(secret, rank, peer)), dtype=torch.uint8)
            for peer in range(size) if peer != rank}   # held until every send is done
    sends = [dist.isend(proof, peer) for peer, proof in mine.items()]
    for peer in range(size):
        if peer == rank:
            continue
        got = torch.empty(32, dtype=torch.uint8)
        dist.recv(got, peer)
        if not hmac.compare_digest(bytes(got.tolist()), _proof(secret, peer, rank)):
            # This rank's own proofs delivered first: a peer then refuses on what it
            # received, not on a connection this rank dropped by leaving.
            for work in sends:
                work.wait()
            raise ForgedValue(f"tensor-parallel rank {peer} did not prove this engine's secret to rank {rank}: "
                              "a process other than the engine's own rank is in the group")
    for work in sends:
        work.wait()


def refusal(cfg: EngineConfig) -> Optional[str]:
    """Why this engine configuration cannot run tensor-parallel, before any model
    is read (the model's shape is checked by model.shard.layout)."""
    if cfg.tensor_parallel_size == 1:
        return None
    if cfg.device != "cpu":
        return ("tensor parallelism runs on CPU (gloo) only: on CUDA the reference has no row-parallel "
                "kernels yet, and VERIFIED would not keep its bits")
    if cfg.dtype != BFLOAT16:
        return ("tensor parallelism needs a bf16 model: only the reference (gateeng-ref-1) keeps VERIFIED "
                "bits equal at every size")
    if cfg.fast_logit_noise:
        return "the test-only fast-path logit noise is not supported with tensor parallelism"
    return None


def threads_per_rank(cfg: EngineConfig) -> int:
    """--threads where given, else the CPUs this process may use (its affinity mask and
    CPU quota, gateeng.cpus) shared out over the ranks (not torch's current setting,
    which an earlier engine may have changed)."""
    return cfg.num_threads or max(1, cpus.budget().threads // cfg.tensor_parallel_size)


def interface_of(address: str) -> str:
    """The name of this machine's network interface that holds `address` (gloo binds a
    rank's listener by interface name)."""
    import psutil
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    raise TensorParallelFailure(f"no network interface of this machine holds {address}")


class LocalRanks:
    """Ranks 1..N-1 as worker processes on this machine (torch.multiprocessing, spawn),
    each handed its shard's tensors through shared memory; the group on loopback.

    What a Group asks of its ranks (fleet.ranks keeps ranks as Ray actors on other
    nodes the same way): `host` and `interface`, the driver's address and its network
    interface; `start(rank, port, secret, timeout)`, a started rank as a handle with a
    `name`, an `exitcode` (None while it runs), `join(timeout)` and `kill()`;
    `wait_any(handles)`, the first of them to end."""
    host, interface = HOST, LOOPBACK_INTERFACE

    def __init__(self, cfg: EngineConfig, model_cfg, lays: list, take, stored_types: dict):
        """`lays`: every rank's ShardLayout; `take(rank)`: that rank's tensors
        (model.shard.shard_tensors), called once per worker as it starts."""
        self._args = cfg, model_cfg, lays, take, stored_types

    def start(self, rank: int, port: int, secret: str, timeout: float):
        cfg, model_cfg, lays, take, stored_types = self._args
        # In a list that each side empties once it is sent or received: the Process
        # object keeps its arguments for its whole life, and would keep the shard too.
        handed = [take(rank)]
        p = mp.get_context("spawn").Process(
            target=_worker_main, name=f"gateeng-tp{rank}", daemon=True,
            args=(rank, port, secret, timeout, cfg, model_cfg, lays[rank], handed, stored_types,
                  threads_per_rank(cfg)))
        p.start()   # pickled now: the shared memory stays open for the worker (a duplicated descriptor)
        handed.clear()
        return p

    @staticmethod
    def wait_any(workers: list):
        by_sentinel = {p.sentinel: p for p in workers}
        return by_sentinel[multiprocessing.connection.wait(list(by_sentinel))[0]]


class Group:
    """The driver's side of the group: starts the workers, announces calls
    (`command`), sends heartbeats, watches the workers, and closes the group."""

    def __init__(self, cfg: EngineConfig, ranks, timeout: float):
        """`ranks`: how ranks 1..N-1 start and are watched (LocalRanks' doc)."""
        self.size = cfg.tensor_parallel_size
        self.ranks = ranks
        self.timeout = timeout
        self.on_death: list = []   # callables(exc), called on the watcher thread when a worker dies
        self.failure: Optional[BaseException] = None
        self._lock = threading.Lock()   # one announced call, with its collectives, at a time
        self._last = time.monotonic()
        self._closing = threading.Event()
        # per engine; reaches the workers only in their start arguments (a spawn pipe, or Ray's own calls)
        secret = secrets.token_hex(32)
        fd = _listener(ranks.host)
        try:
            self._store = dist.TCPStore(ranks.host, _port_of(fd), self.size, True,
                                        timedelta(seconds=STARTUP_SECONDS), wait_for_workers=False,
                                        master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        self._signed = SignedStore(self._store, secret)
        self.workers = []
        try:
            for rank in range(1, self.size):
                self.workers.append(ranks.start(rank, self._store.port, secret, timeout))
            self._await_workers()
            with _gloo_on(ranks.interface):
                dist.init_process_group("gloo", store=self._signed, rank=0, world_size=self.size,
                                        timeout=timedelta(seconds=timeout))
            handshake(0, self.size, secret)
        except BaseException as exc:
            self._kill()
            _leave_group()
            if isinstance(exc, ForgedValue):
                raise ForgedValue(f"tensor-parallel start-up refused: {exc}") from None
            if isinstance(exc, TensorParallelFailure) or not isinstance(exc, Exception):
                raise
            raise TensorParallelFailure(f"tensor-parallel start-up failed ({self._states()}): {exc}") from exc
        threading.Thread(target=self._watch, name="gateeng-tp-watch", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="gateeng-tp-heartbeat", daemon=True).start()

    def _await_workers(self) -> None:
        keys = [f"up/{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self._signed.check(keys):
            dead = [p for p in self.workers if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                why = (f"{dead[0].name} exited with code {dead[0].exitcode} during start-up" if dead else
                       f"the workers did not start within {STARTUP_SECONDS} s")
                raise TensorParallelFailure(f"tensor-parallel start-up failed: {why}")
            time.sleep(0.05)
        for key in keys:   # a mark is a rank's only when signed: a stranger's refuses start-up
            self._signed.get(key)

    @contextlib.contextmanager
    def command(self, message):
        """Announce `message` to every worker and hold the group while the caller
        runs the collectives that go with it."""
        with self._lock:
            if self.failure is not None:
                raise TensorParallelFailure(f"the tensor-parallel group has failed: {self.failure}")
            try:
                dist.broadcast_object_list([message], src=0)
                yield
            except RuntimeError as exc:   # gloo's errors: a closed peer, a timeout
                self.failure = self.failure or exc
                raise TensorParallelFailure(f"a tensor-parallel collective failed ({self._states()}): {exc}") from exc
            finally:
                self._last = time.monotonic()

    # ---- a weight update's phases (engine.tp_weights) ----------------------------
    def prepare_weights(self, paths: tuple) -> None:
        """Every worker starts building its shard of the checkpoint at paths[rank] aside."""
        with self.command((PREPARE, paths)):
            pass

    def weights_states(self) -> list:
        """Every worker's state of the checkpoint it prepares (tp_weights.Aside.state),
        rank 1's first, once none is still building."""
        while True:
            states = [None] * self.size
            with self.command((STATUS,)):
                dist.all_gather_object(states, tp_weights.READY)
            if all(state is not None for state in states[1:]):
                return states[1:]
            time.sleep(STATUS_POLL_S)

    def commit_weights(self) -> None:
        """Every worker swaps in the shard it prepared, before the next call reaches it."""
        with self.command((COMMIT,)):
            pass

    def discard_weights(self) -> None:
        """Every worker drops the shard it prepared. A group that failed has nothing to drop."""
        with contextlib.suppress(TensorParallelFailure):
            with self.command((DISCARD,)):
                pass

    def _states(self) -> str:
        for p in self.workers:   # a rank that just died is reaped, so that its exit code shows
            p.join(timeout=0.5)
        return ", ".join(f"{p.name} {'alive' if p.exitcode is None else f'exited {p.exitcode}'}"
                         for p in self.workers)

    def _watch(self) -> None:
        dead = self.ranks.wait_any(self.workers)
        if self._closing.is_set():
            return
        dead.join(timeout=1)   # reaped, so that its exit code is known
        exc = TensorParallelFailure(f"tensor-parallel worker {dead.name} exited with code {dead.exitcode}")
        self.failure = self.failure or exc
        log(f"{exc}: the engine fails every request")
        for callback in list(self.on_death):
            callback(exc)

    def _heartbeat(self) -> None:
        period = self.timeout / 3
        while not self._closing.wait(period / 4):
            if time.monotonic() - self._last < period or self.failure is not None:
                continue
            with contextlib.suppress(TensorParallelFailure):
                with self.command((PING,)):
                    pass

    def close(self) -> None:
        """Stop the workers (a clean stop where the group still works) and leave the group."""
        if self._closing.is_set():
            return
        if self.failure is None:
            with contextlib.suppress(TensorParallelFailure):
                with self.command((STOP,)):
                    pass
        self._closing.set()
        for p in self.workers:
            p.join(timeout=5)
        self._kill()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _kill(self) -> None:
        self._closing.set()
        for p in self.workers:
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)


def start(cfg: EngineConfig, model, timeout: float, owned: bool = False):
    """(the driver's shard model, its Plans with both plans announcing to the
    group, the Group) for `model` at cfg.tensor_parallel_size. `owned`: no one else
    holds the model, which is let go weight by weight as it is split."""
    why = refusal(cfg)
    if why:
        raise ValueError(why)
    if dist.is_initialized():   # the group is torch.distributed's default one
        raise ValueError("this process already runs a tensor-parallel engine: shut it down first (one "
                         "torch.distributed group per process)")
    torch.set_num_threads(threads_per_rank(cfg))
    units = shard.row_units(model, cfg.tensor_parallel_size)
    lays = [shard.layout(model.cfg, cfg.tensor_parallel_size, r, units) for r in range(cfg.tensor_parallel_size)]
    lay = lays[0]
    try:
        reference_ops.load()
    except reference_ops.ReferenceUnavailable as exc:
        raise ValueError(f"tensor parallelism needs the reference (gateeng-ref-1) on this machine: {exc}") from exc
    stored = packing.of(model)
    stored_types, quant_ops = stored.stored_types, stored.quant_ops
    if owned:   # every rank's part at once, each weight let go once split
        parts = shard.shard_tensors(model, lays, release=True)

        def take(rank: int) -> dict:
            mine, parts[rank] = parts[rank], None
            return mine
    else:       # one rank's part at a time, beside the model its owner keeps
        def take(rank: int) -> dict:
            return shard.shard_tensors(model, [lays[rank]])[0]
    group = Group(cfg, LocalRanks(cfg, model.cfg, lays, take, stored_types), timeout)
    return _driver(cfg, group, lambda: shard.build_shard(model.cfg, lay, take(0), stored_types, quant_ops))


def start_ranks(cfg: EngineConfig, ranks, timeout: float):
    """start's (shard model, plans, Group) where no process holds the whole model: this
    process, rank 0, reads its own shard of cfg.model by byte ranges (model.shard_read),
    and so does each of `ranks` (fleet.ranks: Ray actors on other nodes, LocalRanks' doc)."""
    why = refusal(cfg)
    if why:
        raise ValueError(why)
    if dist.is_initialized():
        raise ValueError("this process already runs a tensor-parallel engine: shut it down first (one "
                         "torch.distributed group per process)")
    torch.set_num_threads(threads_per_rank(cfg))
    try:
        ops = reference_ops.load()
    except reference_ops.ReferenceUnavailable as exc:
        raise ValueError(f"tensor parallelism needs the reference (gateeng-ref-1) on this machine: {exc}") from exc
    mine = shard_read.read_shard(cfg.model, cfg.tensor_parallel_size, 0)
    group = Group(cfg, ranks, timeout)
    return _driver(cfg, group, lambda: shard.build_shard(mine.config, mine.layout, mine.tensors,
                                                         mine.stored_types, ops))


def _driver(cfg: EngineConfig, group: Group, build):
    """Rank 0's shard model (`build()`) and its plans, each announcing its calls to the
    group; the group closed where they cannot be built."""
    try:
        mine = build()
        plans = tp_weights.shard_plans(cfg, mine)
    except BaseException:
        group.close()
        raise
    plans = sharded.announcing(plans, group.command)
    lay = mine.tp.layout
    attention = ("split by head" if lay.attention_split else
                 "whole on every rank (its heads, or its quantized o's GGUF blocks, do not split evenly, "
                 "or a q/k norm spans the whole projection)")
    mlp = "each expert's MLP (the routers whole)" if mine.cfg.moe is not None else "the MLP"
    log(f"tensor parallel: {group.size} ranks on gloo, threads per rank: {threads_per_rank(cfg)}; "
        f"attention {attention}; {mlp}, o and the lm_head split")
    return mine, plans, group


def _leave_group() -> None:
    """Leave the default group after a failed start-up, made or not. torch names a
    group's keys on the store by a per-process counter that only destroying a made
    group puts back; left advanced by a group that failed to form, the next engine's
    driver would wait under other keys than its fresh workers."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    else:
        distributed_c10d._world.group_count = 0


def _port_of(fd: int) -> int:
    """The port a listening socket's file descriptor is bound to (the descriptor stays open)."""
    sock = socket.socket(fileno=fd)
    try:
        return sock.getsockname()[1]
    finally:
        sock.detach()


def _worker_main(rank: int, port: int, secret: str, timeout: float, cfg: EngineConfig, model_cfg, lay, handed: list,
                 stored_types: dict, threads: int) -> None:
    """A worker rank on this machine: its shard from the tensors the driver handed over,
    then serve_rank."""
    torch.set_num_threads(threads)
    # The plain tensors out of the shared memory the driver handed over (which cannot be
    # resized), so that the plain weights the plans do not need can be freed as at size 1;
    # a quantized weight's packed copy is kept as it is, and stays where it was handed over.
    tensors = handed.pop()   # the only reference left to the shared memory: the plain copies go below
    own = {name: t if is_packed(t) else t.clone() for name, t in tensors.items()}
    del tensors
    quantized = any(is_packed(t) for t in own.values())
    model = shard.build_shard(model_cfg, lay, own, stored_types, reference_ops.load() if quantized else None)
    del own
    serve_rank(rank, HOST, port, secret, timeout, cfg, model, LOOPBACK_INTERFACE)


def run_rank(rank: int, host: str, port: int, secret: str, timeout: float, cfg: EngineConfig, threads: int,
             interface: str) -> None:
    """A worker rank that holds no tensor handed over (a Ray actor on another node): it
    reads its own shard of cfg.model by byte ranges (model.shard_read), then serve_rank
    with the driver at `host`, its own gloo listener on `interface`."""
    torch.set_num_threads(threads)
    got = shard_read.read_shard(cfg.model, cfg.tensor_parallel_size, rank)
    model = shard.build_shard(got.config, got.layout, got.tensors, got.stored_types, reference_ops.load())
    del got
    serve_rank(rank, host, port, secret, timeout, cfg, model, interface)


def serve_rank(rank: int, host: str, port: int, secret: str, timeout: float, cfg: EngineConfig, model,
               interface: str) -> None:
    """A worker rank with its shard model: build its plans and KV cache, join the group,
    then run every announced call until the driver says stop (or the group fails)."""
    dtype = DTYPES[cfg.dtype]
    plans = _by_kind(tp_weights.shard_plans(cfg, model))
    kv = KVCache(model.cfg, kv_blocks(cfg), cfg.block_size, dtype, cfg.device)
    aside = tp_weights.Aside()   # a weight update's new shard, built while this rank serves
    store = SignedStore(dist.TCPStore(host, port, cfg.tensor_parallel_size, False,
                                      timedelta(seconds=STARTUP_SECONDS)), secret)
    store.set(f"up/{rank}", "1")
    os.environ[GLOO_IFNAME] = interface   # this process only makes the group (_gloo_on)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.tensor_parallel_size,
                            timeout=timedelta(seconds=timeout))
    handshake(rank, cfg.tensor_parallel_size, secret)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
        what = message[0]
        if what == STOP:
            break
        if what == PREPARE:
            aside.prepare(cfg, message[1][rank], model.tp.layout)
        elif what == STATUS:
            dist.all_gather_object([None] * cfg.tensor_parallel_size, aside.state())
        elif what == COMMIT:   # the KV cache stays: the new shard has the old one's shapes
            model, built = aside.take()
            plans = _by_kind(built)
            trim_heap()   # the old shard's memory goes back to the OS
        elif what == DISCARD:
            aside.discard()
        elif what != PING:
            sharded.run(message, plans, model, kv)
    dist.destroy_process_group()


def _by_kind(plans) -> dict:
    return {PlanKind.FAST: plans.fast, PlanKind.INVARIANT: plans.invariant}
