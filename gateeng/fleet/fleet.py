"""Fleet: what the serving gateway calls an engine, over the Ray replicas.

The gateway and both fronts (serving/) run unchanged over a Fleet: it answers the
calls they make of an Engine (submit with a sink, abort, encode, the model's facts,
update_weights, the gate settings). A request is tokenized here, routed
(router.py), and followed on the fleet's own event loop thread, whose tasks read
each replica's stream of events (a Ray streaming generator) and hand them to the
request's sink.

Exact failover. When a replica dies, each request it ran goes to another replica
(or to the same one once Ray restarted it and it rejoined, as a replica whose
tensor-parallel rank died does: the replica exits with it, and comes back with new
ranks): one serving the weight version its client's tokens came from (each Chunk names the
weight_version that computed it, so a request that slipped through the version
barrier as it closed carries the new version it ran on), or any serving replica if
its client holds no token yet. A VERIFIED request (or any request where the plan
is the invariant one) runs again from its prompt with the same sampling (a seeded
request's seed is drawn here, before its first run, so every run has it): its
tokens are the same bits on every replica, so the tokens its client already has
are checked against the new run's (a difference ends the request with an error,
never a silent change), and the stream continues from where it was. A request of
another mode runs again from the start if its client has no token yet; otherwise
it ends with an error that says so (its output depends on its batch and cannot be
resumed with the same bits).

Weights. update_weights reads the checkpoint once, puts it in Ray's object store,
and has every serving replica prepare it aside (Engine.prepare_weights). A
refusal on any replica discards it on all: nothing changes. Then the front holds
new requests (up to HOLD_S; past it they are refused with a retry hint) and every
replica swaps at its next step boundary, as one server does (requests still
running after --weight-update-wait end with finish_reason abort), under the
fleet's next weight_version; then the front admits again. A request never moves
between versions, so no answer mixes two. A replica that (re)starts serves only
once it holds the fleet's weights: the watcher stages the current checkpoint on
it and swaps it in before it routes a request there.
"""
from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gateeng.config import INVARIANT
from gateeng.engine.aio import Submitted
from gateeng.engine.errors import EngineDead, QueueFull, WeightsRefused
from gateeng.engine.records import Counts
from gateeng.engine.weights import WeightUpdate
from gateeng.fleet import cluster
from gateeng.fleet.router import Router
from gateeng.logs import LOGGER
from gateeng.model.chat import encode_prompt
from gateeng.outputs import Chunk, Completion, Rollback
from gateeng.request import DeterminismParams, Mode, SamplingParams, StreamPolicy

log = LOGGER.getChild("fleet")
POLL_S = 0.5          # how often the watcher asks every replica for its state
STATE_TIMEOUT_S = 10  # a replica that does not answer within this is not routed to
FAILOVER_WAIT_S = 60  # how long a request whose replica died waits for another one
HOLD_S = 60           # past --weight-update-wait, how long new requests wait for a weight swap


@dataclass(frozen=True)
class Loaded:
    """The served model as the fronts name it."""
    source: str
    fingerprint: str


@dataclass(frozen=True)
class Stop:
    eos: frozenset


class Handle:
    """A request as the gateway holds it (aio.stream_request reads these two)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.done = threading.Event()


@dataclass
class _Request:
    request_id: str
    ids: list
    sampling: SamplingParams
    determinism: DeterminismParams
    sink: object
    handle: Handle
    weight_version: Optional[int] = None   # the weights of the tokens its client holds (from their chunks)
    replica: str = ""
    aborted: bool = False
    sent: list = field(default_factory=list)   # the output tokens its client holds
    rerun: Optional[list] = None               # after a failover: the new run's tokens so far


def pin_version(req: _Request, chunk: Chunk) -> None:
    """The first tokens its client is sent fix the weight version a request runs on
    (the chunk's: the replica's engine names the weights that computed them); tokens
    from other weights (a failover's replica that swapped since) end the request."""
    if not chunk.token_ids:
        return
    if not req.sent:
        req.weight_version = chunk.weight_version
    elif chunk.weight_version != req.weight_version:
        raise EngineDead(f"replica {req.replica} ran request {req.request_id} on weight_version "
                         f"{chunk.weight_version}, but the tokens already sent came from weight_version "
                         f"{req.weight_version}: the request ends here")


def runs_on(req: _Request, weight_version: Optional[int]) -> bool:
    """Whether a replica serving `weight_version` may run `req`: once its client holds
    tokens, only on the weights that computed them (a re-run continues that stream);
    before, any (its answer then comes whole from the weights that replica serves)."""
    return not req.sent or weight_version == req.weight_version


def _cause(exc: BaseException) -> BaseException:
    """What a replica raised, out of Ray's wrapper."""
    from ray.exceptions import RayTaskError
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    return exc


def read_checkpoint(path) -> dict:
    """The files of the checkpoint directory `path` that a weight update reads
    (config.json, *.safetensors and their index), by name."""
    hf_dir = Path(str(path or ""))
    if not str(path or "") or not hf_dir.is_dir():
        raise WeightsRefused(f"{path}: not a directory (a Hugging Face directory with config.json and "
                             f"*.safetensors is expected)")
    try:
        return {f.name: f.read_bytes() for f in sorted(hf_dir.iterdir())
                if f.is_file() and f.suffix in (".json", ".safetensors")}
    except OSError as exc:
        raise WeightsRefused(f"{hf_dir}: {exc}") from None


class Fleet:
    def __init__(self, config, replicas: int, cpus: int, served_model_name: Optional[str], max_restarts: int,
                 ray_address: Optional[str] = None):
        import ray
        self.started_ray = cluster.connect(ray_address)
        self.group, self.actors = cluster.place(config, replicas, cpus, served_model_name, max_restarts)
        try:
            facts = ray.get([a.facts.remote() for a in self.actors.values()])
        except Exception:
            self._release()
            raise
        self.facts = facts[0]
        self.record = self.facts.reproducibility
        self.weight_version = 0
        self.margin_threshold, self.max_window = config.margin_threshold, config.max_window
        self.serving: set = set(self.actors)
        self.versions = {name: 0 for name in self.actors}
        self.states: dict = {}
        self.router = Router(block_size=self.facts.config.block_size)
        self.on_death: list = []    # never called: the fleet outlives its replicas (Ray restarts them)
        self.on_health: list = []   # callables(serving: bool), on the fleet's thread, when that changes
        self.accepting = True
        self.observer = None
        self._requests: dict = {}
        self._lock = threading.Lock()
        self._weights_lock = threading.Lock()
        self._open = threading.Event()   # cleared while the replicas swap weights
        self._open.set()
        self._updating = False
        self._checkpoint = None   # the object-store copy of the weights served, for replicas that (re)start
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateeng-fleet", daemon=True)
        self._thread.start()
        self._watcher = asyncio.run_coroutine_threadsafe(self._start_watching(), self.loop).result()
        log.info("fleet of %d replicas up: %s", replicas, ", ".join(sorted(self.actors)))

    # ---- what the fronts read ----------------------------------------------------
    config = property(lambda self: self.facts.config)
    model_config = property(lambda self: self.facts.model_config)
    max_model_len = property(lambda self: self.facts.max_model_len)
    tokenizer = property(lambda self: self.facts.tokenizer)
    version = property(lambda self: self.facts.version)
    selfcheck = property(lambda self: self.facts.selfcheck)
    stop = property(lambda self: Stop(self.facts.eos))
    reproducibility = property(lambda self: self.record)
    loaded = property(lambda self: Loaded(self.facts.source, self.record.model_fingerprint))

    @property
    def failure(self) -> Optional[BaseException]:
        """None while a replica serves: the fleet's health."""
        if self.serving:
            return None
        return EngineDead(f"no replica of the fleet is serving ({len(self.actors)} placed; Ray restarts those "
                          f"that died)")

    @property
    def counts(self) -> Counts:
        states = [self.states[n] for n in sorted(self.serving) if n in self.states]
        if not states:
            return Counts()
        c = [s.counts for s in states]
        return Counts(sum(x.running for x in c), sum(x.waiting for x in c), sum(x.kv_usage for x in c) / len(c),
                      sum(x.preemptions for x in c))

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def encode(self, prompt, chat: bool = False) -> list:
        return encode_prompt(self.tokenizer, prompt, chat)

    def set_observer(self, observer) -> None:
        self.observer = observer
        observer.on_gate_config(self.margin_threshold, self.max_window)

    def set_margin_threshold(self, tau: float) -> None:
        self._set_gate(tau, None)

    def set_max_window(self, window: int) -> None:
        self._set_gate(None, window)

    def _set_gate(self, tau, window) -> None:
        import ray
        ray.get([self.actors[n].set_gate.remote(tau, window) for n in sorted(self.serving)])
        self.margin_threshold = self.margin_threshold if tau is None else tau
        self.max_window = self.max_window if window is None else window
        if self.observer is not None:
            self.observer.on_gate_config(self.margin_threshold, self.max_window)

    # ---- requests ---------------------------------------------------------------
    def submit(self, prompt, params: Optional[SamplingParams] = None, determinism: Optional[DeterminismParams] = None,
               request_id: Optional[str] = None, chat: bool = False, sink=None) -> Handle:
        """Tokenize, route and start one request (on the caller's thread; the gateway's
        tokenizing pool). Raises what the replica's Engine.submit raises."""
        if not self.accepting:
            raise QueueFull("the fleet is shutting down and accepts no new requests")
        params, det = params or SamplingParams(), determinism or DeterminismParams()
        params.validate()
        det.validate()
        ids = self.encode(prompt, chat)
        if params.seed is None and not params.greedy:   # fixed before the first run, so a re-run has it
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        if not self._open.wait(self.config.weight_update_wait + HOLD_S):
            raise QueueFull("the fleet is swapping its weights; retry shortly")
        rid = request_id or "req-" + secrets.token_hex(16)
        req = _Request(rid, ids, params, det, sink, Handle(rid))
        asyncio.run_coroutine_threadsafe(self._begin(req), self.loop).result()
        return req.handle

    def abort(self, request_id: str) -> bool:
        with self._lock:
            req = self._requests.get(request_id)
        if req is None:
            return False
        req.aborted = True
        self.actors[req.replica].abort.remote(request_id)
        return True

    def _choose(self, req: _Request) -> Optional[str]:
        with self._lock:
            candidates = {n for n in self.serving if runs_on(req, self.versions.get(n))}
            name = self.router.choose(req.ids, candidates)
            if name is not None:
                self.router.started(name, req.ids)
            return name

    async def _run_on(self, req: _Request, name: str):
        """Start `req` on replica `name`: its event generator, once the replica took it."""
        gen = self.actors[name].stream.options(num_returns="streaming").remote(
            req.ids, req.sampling, req.determinism, req.request_id)
        try:
            first = await (await gen.__anext__())
        except Exception as exc:
            with self._lock:
                self.router.ended(name)
            raise _cause(exc) from None
        assert isinstance(first, Submitted)
        req.replica = name
        return gen

    async def _begin(self, req: _Request) -> None:
        name = self._choose(req)
        if name is None:
            raise EngineDead("no replica of the fleet is serving; retry shortly")
        gen = await self._run_on(req, name)
        with self._lock:
            self._requests[req.request_id] = req
        self.loop.create_task(self._follow(req, gen))

    async def _follow(self, req: _Request, gen) -> None:
        from ray.exceptions import RayError, RayTaskError
        try:
            while True:
                try:
                    async for ref in gen:
                        if self._forward(req, await ref):
                            return
                    raise EngineDead(f"replica {req.replica} ended request {req.request_id} without its completion")
                except RayTaskError as exc:
                    raise _cause(exc) from None
                except RayError as exc:   # the replica died or cannot be reached
                    gen = await self._failover(req, exc)
        except Exception as exc:
            req.sink(exc if isinstance(exc, EngineDead) else EngineDead(str(exc)))
        finally:
            with self._lock:
                self._requests.pop(req.request_id, None)
                self.router.ended(req.replica)
            req.handle.done.set()

    async def _failover(self, req: _Request, exc: BaseException):
        dead = req.replica
        self._set_down(dead, f"{type(exc).__name__} while running {req.request_id}")
        if req.aborted:
            raise EngineDead(f"replica {dead} died after request {req.request_id} was aborted")
        exact = req.determinism.mode is Mode.VERIFIED or self.config.plan == INVARIANT
        if req.sent and not exact:
            raise EngineDead(f"replica {dead} died after sending {len(req.sent)} tokens of a "
                             f"{req.determinism.mode.value} request, whose output cannot be resumed with the same "
                             f"bits on another replica: retry the request")
        deadline = time.monotonic() + FAILOVER_WAIT_S
        with self._lock:
            self.router.ended(dead)
        while True:   # the dead replica is not serving until Ray restarted it and it rejoined (_check)
            name = self._choose(req)
            if name is not None:
                break
            if time.monotonic() > deadline:
                on = f" weight_version {req.weight_version}" if req.sent else ""
                raise EngineDead(f"replica {dead} died and no other replica serves{on} within "
                                 f"{FAILOVER_WAIT_S} s: retry the request")
            await asyncio.sleep(POLL_S)
        gen = await self._run_on(req, name)
        req.rerun = [] if req.sent else None
        log.warning("replica %s died: request %s runs again on %s (%d tokens already sent, checked as they come)",
                    dead, req.request_id, name, len(req.sent))
        return gen

    def _forward(self, req: _Request, ev) -> bool:
        """Hand `ev` to the request's sink (after a failover, only what its client does
        not hold yet); True once it was the Completion."""
        if isinstance(ev, Completion):
            req.sink(ev)
            return True
        if isinstance(ev, Chunk):
            pin_version(req, ev)
        if req.rerun is None:
            if isinstance(ev, Chunk):
                req.sent.extend(ev.token_ids)
            elif isinstance(ev, Rollback):
                del req.sent[ev.position:]
            req.sink(ev)
            return False
        new, sent = req.rerun, req.sent
        if isinstance(ev, Rollback):
            del new[ev.position:]
            if ev.position < len(sent):
                del sent[ev.position:]
                req.sink(ev)
            return False
        start = len(new)
        new.extend(ev.token_ids)
        for i in range(start, min(len(new), len(sent))):
            if new[i] != sent[i]:
                if req.determinism.stream_policy is not StreamPolicy.EAGER:
                    raise EngineDead(f"after a failover, replica {req.replica} gave token {new[i]} at output "
                                     f"position {i} where token {sent[i]} was sent: the request ends here")
                del sent[i:]   # an EAGER stream's unverified token: withdrawn as one replica would
                req.sink(Rollback(i))
                break
        if len(new) > len(sent):
            k = max(len(sent) - start, 0)
            text = ev.text if k == 0 else self._text(new, len(sent), len(new))
            chunk = Chunk(list(ev.token_ids[k:]), text, len(sent), list(ev.logprobs[k:]) if ev.logprobs else [],
                          ev.weight_version)
            sent.extend(chunk.token_ids)
            req.sink(chunk)
        return False

    def _text(self, ids: list, a: int, b: int) -> str:
        """The text tokens [a, b) add after tokens [0, a)."""
        before = self.tokenizer.decode(ids[:a], skip_special_tokens=True)
        after = self.tokenizer.decode(ids[:b], skip_special_tokens=True)
        return after[len(before):] if after.startswith(before) else self.tokenizer.decode(ids[a:b],
                                                                                          skip_special_tokens=True)

    # ---- replicas' health ----------------------------------------------------------
    def _set_down(self, name: str, why: str) -> None:
        with self._lock:
            if name not in self.serving:
                return
            self.serving.discard(name)
            self.router.forget(name)
            now = bool(self.serving)
        log.warning("replica %s is not serving: %s", name, why)
        if not now:
            self._health(False)

    def _set_up(self, name: str) -> None:
        with self._lock:
            was = bool(self.serving)
            self.serving.add(name)
        log.info("replica %s serves weight_version %d", name, self.weight_version)
        if not was:
            self._health(True)

    def _health(self, serving: bool) -> None:
        for callback in list(self.on_health):
            callback(serving)

    async def _start_watching(self) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._watch())

    async def _stop_watching(self) -> None:
        self._watcher.cancel()
        try:
            await self._watcher
        except asyncio.CancelledError:
            pass

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._check(name) for name in sorted(self.actors)))
            await asyncio.sleep(POLL_S)

    async def _check(self, name: str) -> None:
        from ray.exceptions import RayError
        try:
            state = await asyncio.wait_for(self.actors[name].state.remote(), STATE_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError) as exc:
            self._set_down(name, type(exc).__name__)
            return
        self.states[name] = state
        self.versions[name] = state.weight_version
        if self._updating:
            return
        if name in self.serving:
            if state.weight_version == self.weight_version:
                return
            self._set_down(name, f"restarted on weight_version {state.weight_version}")
        try:
            if state.weight_version != self.weight_version or state.fingerprint != self.record.model_fingerprint:
                await self._join(name)
            await self.actors[name].set_gate.remote(self.margin_threshold, self.max_window)
        except RayError as exc:
            log.warning("replica %s could not join: %s", name, _cause(exc))
            return
        if not self._updating:
            self._set_up(name)

    async def _join(self, name: str) -> None:
        """Bring a (re)started replica to the fleet's weights."""
        actor = self.actors[name]
        await actor.stage_weights.remote([self._checkpoint])
        result = await actor.commit_weights.remote(self.weight_version, "the fleet's current weights")
        self.versions[name] = result.weight_version
        log.info("replica %s joined at weight_version %d", name, result.weight_version)

    # ---- weights -----------------------------------------------------------------
    def update_weights(self, path) -> WeightUpdate:
        """The checkpoint in directory `path` on every replica, switched at a version
        barrier (see the module doc). Raises WeightsRefused (nothing changed)."""
        import ray
        with self._weights_lock:
            t0 = time.perf_counter()
            try:
                files = read_checkpoint(path)
            except WeightsRefused:
                self._observe(False, time.perf_counter() - t0)
                raise
            ref = ray.put(files)
            del files
            self._updating = True
            try:
                names = sorted(self.serving)
                if not names:
                    raise EngineDead("no replica of the fleet is serving: nothing was changed")
                self._stage(names, ref, t0)
                self._open.clear()
                version = self.weight_version + 1
                results = []
                for name, r in zip(names, [self.actors[n].commit_weights.remote(version, str(path)) for n in names]):
                    try:
                        results.append(ray.get(r))
                        self.versions[name] = version
                    except ray.exceptions.RayActorError as exc:   # it restarts, and joins at these weights
                        self._set_down(name, f"died while swapping weights: {exc}")
                if not results:
                    raise EngineDead("every replica died while swapping the weights in")
                self.weight_version, self._checkpoint = version, ref
                self.record = dataclasses.replace(self.record, model_fingerprint=results[0].model_fingerprint,
                                                  weight_version=version)
                for name in list(self.serving):
                    if self.versions.get(name) != version:
                        self._set_down(name, "not on the new weights")
            finally:
                self._updating = False
                self._open.set()
            seconds = time.perf_counter() - t0
            self._observe(True, seconds)
            log.info("weights from %s on %d replicas: weight_version %d, fingerprint %s, %.2f s", path,
                     len(results), version, results[0].model_fingerprint[:16], seconds)
            return WeightUpdate(results[0].model_fingerprint, version, seconds,
                                sum(r.requests_ended for r in results))

    def _stage(self, names: list, ref, t0: float) -> None:
        """Prepare the checkpoint aside on every replica of `names`; on any failure
        discard it everywhere and raise (the refusal a replica gave, if one did)."""
        import ray
        refs = [self.actors[n].stage_weights.remote([ref]) for n in names]
        failure = None
        for name, r in zip(names, refs):
            try:
                ray.get(r)
            except ray.exceptions.RayError as exc:
                cause = _cause(exc)
                if failure is None or (isinstance(cause, ValueError) and not isinstance(failure, ValueError)):
                    failure = cause if isinstance(cause, ValueError) else EngineDead(
                        f"replica {name} failed to stage the checkpoint ({cause}): nothing was changed")
        if failure is not None:
            for n in names:
                try:
                    ray.get(self.actors[n].discard_weights.remote())
                except ray.exceptions.RayError:
                    pass
            self._observe(False, time.perf_counter() - t0)
            raise failure

    def _observe(self, applied: bool, seconds: float) -> None:
        if self.observer is not None:
            self.observer.on_weight_update(applied, seconds, self.weight_version)

    # ---- the end -----------------------------------------------------------------
    def shutdown(self, drain_seconds: float = 0.0) -> None:
        """Stop admitting; let requests finish for up to drain_seconds; abort the rest;
        stop the replicas (and the Ray this process started)."""
        self.accepting = False
        deadline = time.monotonic() + drain_seconds
        while self._requests and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid in list(self._requests):
            self.abort(rid)
        deadline = time.monotonic() + 5
        while self._requests and time.monotonic() < deadline:
            time.sleep(0.05)
        asyncio.run_coroutine_threadsafe(self._stop_watching(), self.loop).result(timeout=STATE_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self._release()

    def _release(self) -> None:
        import ray
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        ray.util.remove_placement_group(self.group)
        if self.started_ray:
            ray.shutdown()
