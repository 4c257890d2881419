"""Tensor parallelism's rendezvous on the tiny random-weight Llama (gloo, one thread
per rank): the store and every gloo listener are on 127.0.0.1, whatever
GLOO_SOCKET_IFNAME says; a value on the store not made with the engine's secret is
refused; a process in the group without the secret cannot pass the handshake."""
import multiprocessing
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from gateeng.config import EngineConfig
from gateeng.engine import tp_processes as tp
from gateeng.engine.engine import Engine
from gateeng.request import DeterminismParams, Mode, SamplingParams
from tests.tiny import tiny_loaded


def engine(size: int) -> Engine:
    cfg = EngineConfig(tensor_parallel_size=size, num_kv_blocks=64, max_num_seqs=4, num_threads=1)
    return Engine(cfg, loaded=tiny_loaded("bfloat16"))


def listening(pid: int) -> set:
    """(address, port) of every listening TCP socket process `pid` holds, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:   # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:   # 0A: LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))
            found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def test_signed_store_refuses_values_without_the_secret():
    raw = dist.HashStore()
    mine = tp.SignedStore(raw, "right")
    mine.set("up/1", "1")
    assert mine.get("up/1") == b"1" and mine.check(["up/1"])
    with pytest.raises(tp.ForgedValue, match="not made with this engine's secret"):
        tp.SignedStore(raw, "wrong").get("up/1")
    raw.set("up/2", raw.get("up/1"))   # a signed value moved to another key
    with pytest.raises(tp.ForgedValue, match="'up/2'"):
        mine.get("up/2")
    for forged in (b"1", b"x" * 40, b""):   # a stranger's plain write
        raw.set("up/1", forged)
        with pytest.raises(tp.ForgedValue):
            mine.get("up/1")


def test_the_store_and_gloo_listen_on_loopback_only(monkeypatch):
    others = [name for _, name in socket.if_nameindex() if name != tp.LOOPBACK_INTERFACE]
    if others:   # where the operator's environment names another interface, loopback still wins
        monkeypatch.setenv(tp.GLOO_IFNAME, others[0])
    before = listening(os.getpid())
    e = engine(2)
    try:
        ours = listening(os.getpid()) - before   # the store's and the driver's gloo listener
        workers = [listening(p.pid) for p in e.core.tp_group.workers]
        assert len(ours) >= 2 and all(workers), (ours, workers)
        for addr, port in ours.union(*workers):
            assert addr == "127.0.0.1", (addr, port)
        assert os.environ.get(tp.GLOO_IFNAME) == (others[0] if others else None)   # put back
        got = e.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True), DeterminismParams(Mode.VERIFIED))
        assert len(got.token_ids) == 4
    finally:
        e.shutdown()


def test_a_stranger_marking_a_rank_up_on_the_store_is_refused():
    """A local process finds the store's port and writes rank 1's readiness mark
    before the worker does: the engine refuses to start, and its workers are gone."""
    before = listening(os.getpid())
    wrote = []

    def stranger():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = listening(os.getpid()) - before
            if new:
                (_, port), = new
                store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
                store.set("up/1", "1")
                wrote.append(port)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=stranger)
    thread.start()
    try:
        with pytest.raises(tp.ForgedValue, match="start-up refused: .*'up/1'.*not made with this engine's secret"):
            engine(2)
    finally:
        thread.join()
    assert wrote
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("gateeng-tp")]
    assert not dist.is_initialized()


def _rank_signing_with(path: str, secret: str) -> None:
    dist.init_process_group("gloo", store=tp.SignedStore(dist.FileStore(path, 2), secret), rank=1, world_size=2,
                            timeout=timedelta(seconds=10))


def test_a_gloo_address_not_made_with_the_secret_is_refused(tmp_path):
    """A stranger that writes a rank's gloo address (to be connected to in its place)
    makes the group's creation fail at once, before any connection is made."""
    path = str(tmp_path / "store")
    stranger = mp.get_context("spawn").Process(target=_rank_signing_with, args=(path, "a guess"), daemon=True)
    stranger.start()
    try:
        with pytest.raises(tp.ForgedValue, match="holds a value not made with this engine's secret"):
            dist.init_process_group("gloo", store=tp.SignedStore(dist.FileStore(path, 2), "the engine's secret"),
                                    rank=0, world_size=2, timeout=timedelta(seconds=10))
    finally:
        stranger.join(timeout=10)
        if stranger.exitcode is None:
            stranger.kill()
        tp._leave_group()
    assert not dist.is_initialized()
    assert tp.distributed_c10d._world.group_count == 0   # the next group is named as its fresh peers name it


def _rank_without_the_secret(path: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=1, world_size=2,
                            timeout=timedelta(seconds=10))
    tp.handshake(1, 2, "a guess")


def test_a_process_in_the_group_without_the_secret_fails_the_handshake(tmp_path):
    """One that took a rank's place on a gloo connection: the driver refuses it before
    any row is sent, and it learns nothing it could show in another rank's place."""
    path = str(tmp_path / "store")
    stranger = mp.get_context("spawn").Process(target=_rank_without_the_secret, args=(path,), daemon=True)
    stranger.start()
    try:
        dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=0, world_size=2,
                                timeout=timedelta(seconds=10))
        with pytest.raises(tp.ForgedValue, match="rank 1 did not prove this engine's secret to rank 0"):
            tp.handshake(0, 2, "the engine's secret")
        stranger.join(timeout=30)   # its own gloo wait may take the whole 10 s timeout first
        assert stranger.exitcode == 1   # its side refused the engine's proof too
    finally:
        if stranger.exitcode is None:
            stranger.kill()
        dist.destroy_process_group()
