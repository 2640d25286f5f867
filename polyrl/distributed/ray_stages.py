"""Worker groups on Ray (`trainer.launcher=ray`, docs/ray.md): a rollout pool and a reward pool that the training
loop drives through the same calls it makes on its local stages.

* `RayRollout.rollout(...)` has the signature of `sampling.diffusion.rollout` without the adapter: the driver
  encodes the prompts (its prompt cache), the step's samples go in chunks of `rollout.batch_size` to the
  least-loaded rollout replica, each replica samples and decodes from the noise the driver drew, and each chunk
  goes to the reward sink as soon as it is back (in sample order). The same noise and chunking as in one process,
  so the same numbers.
* `RayRewardStage` has the interface of `rewards.stage.RewardStage` (`reads_media`, `begin` → put / finish /
  cancel): each chunk is scored by the least-loaded reward worker; a chunk sampled on a rollout replica reaches
  the reward worker as an object reference, without passing through the driver.
* Weights reach the rollout replicas through `weight_sync` (full once, then trainable tensors; checksummed).

Failures: a replica that dies (its process killed, a node lost) is restarted by Ray (`ray.max_restarts`); the
chunks it held are sent again, to it (after a full weight sync) or to another replica. Only chunks that came back
are scored, so nothing is scored twice. Errors raised by the stage code itself (a weight sync that did not bind,
a reward that failed) are not retried: they stop the step.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError
from torch.utils._pytree import tree_map

from ..batch import Rollout
from ..latents import cat_latents, to_device
from ..media import cat_media, primary
from ..rewards import REWARDS, build_reward
from ..rewards.base import call_reward
from ..rewards.stage import WallTimer, checked_scores, merge_extras, reward_latents
from ..sampling.diffusion import MediaChunk, RolloutNoise, SamplingPlan, decode_chunk, sample_latents
from .weight_sync import NeedsFullSync, WeightPayload, WeightReceiver, WeightSyncError


def least_loaded(loads: list[int], alive: list[bool]) -> int:
    """The live replica with the fewest calls in flight (the lowest index among equals)."""
    candidates = [i for i in range(len(loads)) if alive[i]]
    if not candidates:
        raise RuntimeError("every replica of the pool died (more restarts than ray.max_restarts)")
    return min(candidates, key=lambda i: (loads[i], i))


def connect(address: str | None, num_cpus: int | None) -> bool:
    """Join the Ray cluster at `address`, or start a local one; True when this call started it (then the caller
    shuts it down). A process already connected is left as it is."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=True)
        return True
    env = {}
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        # the driver trains on the first GPU: a local Ray gets the others (it reads them when it starts)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(ids[1:])}
    with _environ(env):
        ray.init(num_cpus=num_cpus, num_gpus=max(torch.cuda.device_count() - 1, 0) if env else None,
                 include_dashboard=False, log_to_driver=True)
    return True


@contextmanager
def _environ(values: dict[str, str]):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class StageHost:
    """The body of every Ray actor of a pool: builds its stage object from a factory, then runs its methods."""

    def __init__(self, factory: Callable[[], object]):
        self.stage = factory()

    def call(self, method: str, *args):
        return getattr(self.stage, method)(*args)

    def pid(self) -> int:
        return os.getpid()


@dataclass
class Call:
    replica: int
    refs: list  # the call's object references (one per return value)
    args: tuple = ()


def is_worker_loss(error: BaseException) -> bool:
    """A call that failed because its worker process went away (Ray restarts it), not because the stage raised."""
    return isinstance(error, RayActorError)


def needs_full_sync(error: BaseException) -> bool:
    """A replica that has lost its weights (restarted) answered: it needs a full sync, then the call again."""
    return isinstance(error, NeedsFullSync) or isinstance(getattr(error, "cause", None), NeedsFullSync)


class WorkerPool:
    """`size` Ray actors hosting the same stage; each call goes to the least-loaded live replica."""

    def __init__(self, name: str, factory: Callable[[], object], size: int, num_cpus: float = 1.0,
                 num_gpus: float = 0.0, max_restarts: int = 3):
        host = ray.remote(StageHost)
        self.name, self.max_restarts = name, max_restarts
        # max_task_retries=0: a call lost with its worker is re-sent by us, after the restarted replica is set up
        self.handles = [host.options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=max_restarts,
                                     max_task_retries=0).remote(factory) for _ in range(size)]
        self.loads = [0] * size
        self.alive = [True] * size
        self.losses = [0] * size  # worker processes lost (each restarted by Ray while within max_restarts)
        self.known_pids: list[int | None] = [None] * size
        self.submitted: dict[tuple[int, str], int] = {}  # calls sent, by (replica, method)

    def __len__(self) -> int:
        return len(self.handles)

    def pick(self) -> int:
        return least_loaded(self.loads, self.alive)

    def submit(self, method: str, *args, replica: int | None = None, num_returns: int = 1) -> Call:
        r = self.pick() if replica is None else replica
        refs = self.handles[r].call.options(num_returns=num_returns).remote(method, *args)
        self.loads[r] += 1
        self.submitted[r, method] = self.submitted.get((r, method), 0) + 1
        return Call(r, refs if num_returns > 1 else [refs], args)

    def done(self, call: Call) -> None:
        self.loads[call.replica] -= 1

    def ready(self) -> None:
        """Wait until every replica is built (its factory ran) and note its process."""
        self.known_pids = self.pids()

    def lost(self, call: Call, patience_s: float = 600.0) -> None:
        """The call's worker went away. Wait for Ray's restart and count each new process once (the calls that
        were in flight on one process all report its loss); a replica Ray gave up on (past ray.max_restarts) is
        out of the pool."""
        r = call.replica
        deadline = time.monotonic() + patience_s
        while True:
            try:
                pid = ray.get(self.handles[r].pid.remote())
                break
            except ActorUnavailableError:  # restarting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
            except RayActorError:  # dead for good
                self.alive[r] = False
                return
        if pid != self.known_pids[r]:
            self.losses[r] += 1
            self.known_pids[r] = pid

    def get(self, call: Call):
        """The call's (first) result, waiting for it."""
        try:
            return ray.get(call.refs[0])
        finally:
            self.done(call)

    def call_all(self, method: str, *args) -> list:
        return [self.get(self.submit(method, *args, replica=r)) for r in range(len(self)) if self.alive[r]]

    def pids(self) -> list[int]:
        return ray.get([h.pid.remote() for h in self.handles])

    def close(self) -> None:
        for h in self.handles:
            ray.kill(h, no_restart=True)
        self.handles = []


# ------------------------------------------------------------------------------------------ worker-side stages
class RolloutReplica:
    """A rollout replica: the policy (built by `build_policy`, the actor's networks without an optimizer), the
    weights it received, and the sampler of one chunk."""

    def __init__(self, build_policy: Callable[[], object]):
        self.policy = build_policy()
        self.receiver = WeightReceiver(self.policy.modules)

    def load_weights(self, payload: WeightPayload) -> dict:
        return self.receiver.apply(payload)

    def weights_version(self) -> int | None:
        return self.receiver.version

    @torch.no_grad()
    def sample(self, cond: dict, shared: dict, noise: RolloutNoise, plan: SamplingPlan, decode: bool):
        """((window latents, log-probs, sigmas, levels, final, means), info), media: `sample_latents` and the
        decode of one chunk; `info` says which weights sampled it, the decode seconds and the FLOPs."""
        if self.receiver.version is None:  # a restarted replica that a call reached before its full sync
            raise NeedsFullSync("this rollout replica has received no weights (fresh or restarted)")
        device = self.policy.device
        flops = getattr(self.policy, "flops", 0.0)
        cond = to_device(cond, device)
        part = sample_latents(self.policy, cond, to_device(shared, device), noise, plan)
        media, ready = decode_chunk(self.policy, part.final, cond) if decode else (None, lambda: 0.0)
        decode_s = ready()
        part = tree_map(lambda t: t.cpu(), part)  # the reply is pickled from host memory
        info = {"version": self.receiver.version, "decode_s": decode_s,
                "flops": getattr(self.policy, "flops", 0.0) - flops}
        return (part, info), media


class RewardScorer:
    """A reward worker: the reward of the run's config, scoring one chunk per call. `scored()` lists what it
    scored ((tag, first sample, end) per call) for the run's diagnostics and tests."""

    def __init__(self, reward_cfg: dict, name: str, extra_rewards: dict | None = None):
        for key, cls in (extra_rewards or {}).items():  # rewards registered in the driver's process (--import)
            REWARDS.setdefault(key, cls)
        self.reward, self.name = build_reward(reward_cfg), name
        if hasattr(self.reward, "preflight"):
            self.reward.preflight()
        self.log: list[tuple] = []

    @torch.no_grad()
    def score(self, tag, start: int, media, prompts: list, metadata: list, final: dict):
        t0 = time.perf_counter()
        out = call_reward(self.reward, primary(media), prompts, metadata, latents=reward_latents(final))
        scores = checked_scores(out, self.name, len(prompts))
        self.log.append((tag, start, start + len(prompts)))
        return scores, out.extras, time.perf_counter() - t0

    def scored(self) -> list[tuple]:
        return list(self.log)


# ------------------------------------------------------------------------------------------ driver-side stages
class RayRewardStage:
    """`rewards.stage.RewardStage` over a pool of `RewardScorer` workers."""

    def __init__(self, pool: WorkerPool, reads_media: bool):
        self.pool, self.reads_media = pool, reads_media
        self.steps = 0

    def begin(self, prompts: list, metadata: list[dict], group_ids=None) -> RemoteScoring:
        """`group_ids` (what the local stage uses for group rewards) are not used: the reward workers score chunks,
        so a group reward fails there (docs/rewards.md, "Group rewards")."""
        self.steps += 1
        return RemoteScoring(self.pool, list(prompts), list(metadata), self.steps)

    def end_step(self) -> None:
        """Nothing: the workers' rewards keep no per-step state here (reward=mix's `running` normalisation there uses
        each call's own scores; docs/rewards.md)."""

    def checkpoint_extra(self) -> dict:
        return {}

    def load_reward_state(self, state) -> None:
        pass

    def close(self) -> None:
        self.pool.close()


class RemoteScoring:
    """One step's scoring on the reward pool: `put(chunk)` sends the chunk to a worker, `finish` collects."""

    takes_refs = True  # a chunk's media may be an object reference (sampled on a rollout replica)

    def __init__(self, pool: WorkerPool, prompts: list, metadata: list[dict], tag: int):
        self.pool, self.prompts, self.metadata, self.tag = pool, prompts, metadata, tag
        self.calls: dict[int, Call] = {}

    def put(self, chunk: MediaChunk) -> None:
        chunk.ready()  # Ray pickles the arguments now: a local GPU rollout's copies to the host must have landed
        s = chunk.index
        self.calls[s.start] = self.pool.submit("score", self.tag, s.start, chunk.media, self.prompts[s],
                                               self.metadata[s], chunk.final)

    def finish(self, batch: Rollout, timer: WallTimer | None = None) -> dict[str, float]:
        timer = timer or WallTimer()
        results = {}
        with timer("reward_wait"):
            for start in sorted(self.calls):
                while start not in results:
                    call = self.calls.pop(start)  # `get` settles its load, answer or not
                    try:
                        results[start] = self.pool.get(call)
                    except BaseException as e:
                        if not is_worker_loss(e):
                            self.cancel()
                            raise
                        self.pool.lost(call)
                        self.calls[start] = self.pool.submit("score", *call.args)
        n = sum(len(s) for s, _, _ in results.values())
        if n != len(batch):
            raise RuntimeError(f"the reward pool scored {n} of {len(batch)} samples: the rollout did not hand every "
                               "chunk to the reward stage")
        ordered = [results[k] for k in sorted(results)]
        batch.rewards = torch.cat([s for s, _, _ in ordered])
        batch.reward_extras = merge_extras([(len(s), e) for s, e, _ in ordered])
        timer.times["time/reward"] = timer.times.get("time/reward", 0.0) + sum(t for _, _, t in ordered)
        return timer.times

    def cancel(self) -> None:
        for call in self.calls.values():
            _cancel(call)
            self.pool.done(call)
        self.calls = {}


@dataclass
class _Job:
    """One step's rollout on the pool: its inputs, chunk slices and the calls in flight."""

    prompts: list
    cond: dict
    shared: dict
    shared_ref: object
    noise: RolloutNoise
    plan: SamplingPlan
    decode: bool
    slices: list[slice]
    calls: dict[int, Call] = field(default_factory=dict)


class RayRollout:
    """The rollout stage over a pool of `RolloutReplica`s. `encoder` is the driver's policy (prompt encoding);
    `weights(full)` makes a payload of the actor's sampling weights now; `version()` is the actor's update count."""

    def __init__(self, pool: WorkerPool, encoder, weights: Callable[[bool], WeightPayload], version: Callable[[], int]):
        self.pool, self.encoder, self.weights, self.version = pool, encoder, weights, version
        self.synced: list[int | None] = [None] * len(pool)  # the version each replica holds (None: no full sync)
        self.prefetched: deque[_Job] = deque()
        self.resends = 0  # chunks sent again after their replica was lost
        self.sync_log: list[dict] = []  # what each weight sync moved (replica, full, bytes, tensors)
        self._payloads: dict[tuple[int, bool], object] = {}

    # ---------------------------------------------------------------------------------------- weights
    def sync(self) -> dict[str, float]:
        """Bring every live replica to the actor's current weights (after each update); returns the bytes moved."""
        moved = 0
        for r in range(len(self.pool)):
            if self.pool.alive[r]:
                moved += self._ensure_synced(r)
        self._payloads = {}
        return {"weight_sync/bytes": float(moved)}

    def _payload(self, version: int, full: bool):
        key = (version, full)
        if key not in self._payloads:
            self._payloads = {k: v for k, v in self._payloads.items() if k[0] == version}
            self._payloads[key] = ray.put(self.weights(full))
        return self._payloads[key]

    def _ensure_synced(self, r: int) -> int:
        """Sync replica r if it is behind: full when it never had one (fresh or restarted), else the trainable
        tensors. Waits for the replica's answer, so a sync that did not bind stops here, loudly."""
        version = self.version()
        for _ in range(self.pool.max_restarts + 2):
            if self.synced[r] == version:
                return 0
            full = self.synced[r] is None
            call = self.pool.submit("load_weights", self._payload(version, full), replica=r)
            try:
                report = self.pool.get(call)
            except BaseException as e:
                if is_worker_loss(e):
                    self.pool.lost(call)  # waits for Ray's restart
                elif not needs_full_sync(e):  # (restarted while idle: it lost its weights)
                    raise
                if not self.pool.alive[r]:
                    return 0
                self._recheck(r)
                continue
            self.synced[r] = version
            self.sync_log.append({"replica": r, "full": full, "bytes": report["bytes"], "tensors": report["bound"],
                                  "version": version})
            return report["bytes"]
        raise WeightSyncError(f"rollout replica {r} could not be brought to weights version {version}")

    def _recheck(self, r: int) -> None:
        """After a failed call on replica r: ask which weights it holds now (a restarted replica holds none;
        calls run in order, so the answer covers every sync sent before)."""
        if not self.pool.alive[r]:
            return
        try:
            self.synced[r] = self.pool.get(self.pool.submit("weights_version", replica=r))
        except RayActorError:
            self.synced[r] = None  # lost again: the next sync to it is full

    # ---------------------------------------------------------------------------------------- sampling
    def prefetch(self, prompts: list, plan: SamplingPlan, noise: RolloutNoise, decode: bool) -> None:
        """Start a later step's rollout now (rollout.max_staleness): it samples with the weights the replicas hold
        until the next sync; the `rollout` call of that step collects it."""
        self.prefetched.append(self._start(prompts, plan, noise, decode))

    def rollout(self, prompts: list, metadata: list[dict], group_ids: torch.Tensor, plan: SamplingPlan,
                noise: RolloutNoise, decode: bool = True, sink=None, times: dict | None = None) -> Rollout:
        """`sampling.diffusion.rollout` on the pool (see the module docstring)."""
        job = self.prefetched.popleft() if self.prefetched else None
        if job is not None and (job.prompts != list(prompts) or not _same_noise(job.noise, noise)):
            raise RuntimeError("the prefetched rollout is not this step's (prompts or noise differ)")
        job = job or self._start(prompts, plan, noise, decode)
        return self._collect(job, metadata, group_ids, sink, times)

    def _start(self, prompts: list, plan: SamplingPlan, noise: RolloutNoise, decode: bool) -> _Job:
        cond = {k: v.cpu() for k, v in self.encoder.encode_prompts(prompts).items()}
        shared = {k: v.cpu() for k, v in self.encoder.encode_guidance(plan.guidance).items()}
        b = len(prompts)
        slices = [slice(i, min(b, i + plan.batch_size)) for i in range(0, b, plan.batch_size)]
        job = _Job(list(prompts), cond, shared, ray.put(shared), noise, plan, decode, slices)
        for i in range(len(slices)):
            self._send(job, i)
        return job

    def _send(self, job: _Job, i: int) -> None:
        while True:  # the least-loaded live replica, brought to the current weights first
            r = self.pool.pick()
            self._ensure_synced(r)
            if self.pool.alive[r]:
                break
        s = job.slices[i]
        idx = torch.arange(s.start, s.stop)
        job.calls[i] = self.pool.submit("sample", {k: v[s] for k, v in job.cond.items()}, job.shared_ref,
                                        job.noise.select(idx), job.plan, job.decode, replica=r, num_returns=2)

    def _collect(self, job: _Job, metadata: list[dict], group_ids: torch.Tensor, sink, times: dict | None) -> Rollout:
        n = len(job.slices)
        parts, infos, media = [None] * n, [None] * n, [None] * n
        local_sink = sink is not None and not getattr(sink, "takes_refs", False)
        fetch = job.decode and (sink is None or local_sink)
        put = 0  # chunks go to the sink in sample order
        waiting = {job.calls[i].refs[0]: i for i in range(n)}
        try:
            while waiting:
                [ready], _ = ray.wait(list(waiting), num_returns=1)
                i = waiting.pop(ready)
                call = job.calls[i]
                try:
                    parts[i], infos[i] = ray.get(ready)
                except BaseException as e:
                    self.pool.done(call)
                    if is_worker_loss(e):
                        self.pool.lost(call)  # waits for Ray's restart
                    elif not needs_full_sync(e):  # (it reached a restarted replica before our full sync did)
                        raise
                    self._recheck(call.replica)
                    self.resends += 1
                    self._send(job, i)
                    waiting[job.calls[i].refs[0]] = i
                    continue
                self.pool.done(call)
                media[i] = (ray.get(call.refs[1]) if fetch else call.refs[1]) if job.decode else None
                while put < n and parts[put] is not None:
                    if sink is not None:
                        decode_s = infos[put]["decode_s"]
                        sink.put(MediaChunk(job.slices[put], parts[put][4], media[put], lambda d=decode_s: d))
                    put += 1
        except BaseException:
            for i in waiting.values():
                _cancel(job.calls[i])
                self.pool.done(job.calls[i])
            raise
        current = self.version()
        sizes = [s.stop - s.start for s in job.slices]
        staleness = [current - info["version"] for info in infos]
        if times is not None:
            if job.decode:
                times["time/decode"] = times.get("time/decode", 0.0) + sum(info["decode_s"] for info in infos)
            times["rollout/staleness"] = sum(s * k for s, k in zip(staleness, sizes, strict=True)) / sum(sizes)
            times["rollout/staleness_max"] = float(max(staleness))
        if hasattr(self.encoder, "flops"):  # the step's FLOPs count the replicas' sampling, as in one process
            self.encoder.flops += sum(info["flops"] for info in infos)
        latents, log_probs, sigmas, levels, final, means = (
            cat_latents(list(t)) if isinstance(t[0], dict) else torch.cat(t) for t in zip(*parts, strict=True))
        return Rollout(
            prompts=list(job.prompts), metadata=list(metadata), group_ids=group_ids, cond=job.cond, shared=job.shared,
            latents=latents, log_probs=log_probs, sigmas=sigmas, noise_levels=levels, final=final,
            media=cat_media(media) if fetch else None, old_means=means,
        )

    def close(self) -> None:
        self.prefetched.clear()
        self.pool.close()


def _cancel(call: Call) -> None:
    """Drop a call whose result is no longer wanted (best effort: one already running finishes on its worker)."""
    with suppress(Exception):
        ray.cancel(call.refs[0])


def _same_noise(a: RolloutNoise, b: RolloutNoise) -> bool:
    return torch.equal(a.starts, b.starts) and all(torch.equal(a.initial[k], b.initial[k]) for k in b.initial)
