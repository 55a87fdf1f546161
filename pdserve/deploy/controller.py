"""The controller: a named (optionally detached) async Ray actor that owns one deployment and
keeps it as declared, whoever started it and whether or not that driver is still there.

    pdserve ray up --detach   creates `<name>-controller` in namespace `pdserve` with
                              lifetime=detached, waits until every process is ready, exits
    pdserve ray status|scale|logs|down   look the actor up and call it

It runs one reconcile loop (every `reconcile_period_s`): poll the ready processes, reap the
dead (a process exit, a lost actor or node), take an autoscaling decision when one is due,
then start or drain members to match the targets (`reconcile.plan`). Placing and starting a
member, and draining one, run as their own tasks, so the loop never waits for a model load and
`status`, `scale` and health answer at once while a scale or a start is under way.

The actors it creates (`ProcessActor`, `RankHolder`) are owned by it: if the controller dies,
they die, and their processes with them (parent-death signal), so a dead controller leaves
nothing serving. Arguments and results are plain data (`schema.dump` of the spec and status).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from collections import deque
from typing import Any

from pdserve.deploy import members, reconcile, schema
from pdserve.deploy.autoscale import AutoscalePolicy, AutoscaleState, WorkerLoad
from pdserve.deploy.autoscale_loop import Cadence, describe
from pdserve.deploy.members import CALL_TIMEOUT_S, MemberState
from pdserve.deploy.reconcile import Phase
from pdserve.deploy.spec import ROLES, RayClusterSpec
from pdserve.deploy.status import DeploymentStatus, Event

log = logging.getLogger(__name__)

NAMESPACE = "pdserve"
EVENTS_KEPT = 50


class Controller:
    """Runs inside Ray as an async actor (`ray.remote(Controller)`); one per deployment."""

    def __init__(self, spec: dict[str, Any]) -> None:
        _log_to_stderr()  # every event in this actor's Ray log (worker-*.err), with time
        self.spec: RayClusterSpec = schema.load(RayClusterSpec, spec)
        if not self.spec.cluster_secret:  # every process of this deployment shares one
            self.spec = dataclasses.replace(self.spec, cluster_secret=secrets.token_urlsafe(32))
        self.targets = self.spec.replicas()
        self.members: dict[str, MemberState] = {}
        self.events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self.failures: list[str] = []
        self.backoff = reconcile.Backoff(self.spec.restart_backoff_s)
        self._serials = itertools.count()
        self._ids = {role: itertools.count() for role in self.targets}
        self._loop: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._policy = None if self.spec.autoscale is None else AutoscalePolicy(
            self.spec.autoscale)
        self._autoscale_state = AutoscaleState()
        self._cadence: Cadence | None = None
        self._last_decision = ""

    # -- the API (every method answers at once, or waits only on its own condition) --------
    async def ping(self) -> str:
        self._ensure_loop()
        return self.spec.name

    async def pid(self) -> int:
        import os

        return os.getpid()

    async def node_id(self) -> str:
        """The Ray node this controller runs on (the head's)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def spec_dict(self) -> dict[str, Any]:
        return schema.dump(self.spec)

    async def status(self) -> dict[str, Any]:
        self._ensure_loop()
        now = time.monotonic()
        return schema.dump(DeploymentStatus(
            name=self.spec.name, targets=dict(self.targets),
            processes=tuple(m.status(now) for m in sorted(
                self.members.values(), key=lambda m: (_ROLE_ORDER[m.role], m.serial))),
            events=tuple(self.events), autoscale=self._last_decision,
            backoff={r: self.backoff.failures(r) for r in self.targets
                     if self.backoff.failures(r)}))

    async def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Wait until every role has its declared number of ready processes. {"ok": True},
        or {"ok": False, "error": why} as soon as a start fails (its stderr's last lines)
        or when `timeout_s` runs out."""
        self._ensure_loop()
        mark = len(self.failures)
        end = time.monotonic() + timeout_s
        while True:
            st = schema.load(DeploymentStatus, await self.status())
            if st.converged:
                return {"ok": True}
            if len(self.failures) > mark:
                return {"ok": False, "error": self.failures[mark]}
            if time.monotonic() > end:
                waiting = [f"{p.name} {p.phase}" for p in st.processes if p.phase != "ready"]
                return {"ok": False, "error": f"not ready after {timeout_s:g}s: "
                        f"{', '.join(waiting) or 'processes still to be started'}"}
            await asyncio.sleep(0.2)

    async def scale(self, role: str, replicas: int) -> dict[str, Any]:
        """Set the declared size of `role`; the loop starts or drains members to match (wait
        with `wait_ready`). {"role", "from", "to", "note"}."""
        self._ensure_loop()
        if role not in self.targets or (role == "router" and self.spec.router is None):
            roles = [r for r in self.targets if r != "router" or self.spec.router is not None]
            raise ValueError(f"no role {role!r} in this deployment (roles: {', '.join(roles)})")
        if not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas must be an integer >= 0, got {replicas!r}")
        note = ""
        if self._policy is not None and role in ROLES:
            rule = self._policy.config.rule(role)
            note = (f"autoscaling is on: {role} stays within [{rule.min_replicas}, "
                    f"{rule.max_replicas}] and later decisions may change it")
        before, self.targets[role] = self.targets[role], replicas
        self._event(f"scale {role}: {before} -> {replicas}")
        self._poke()
        return {"role": role, "from": before, "to": replicas, "note": note}

    async def logs(self, name: str, lines: int = 40) -> dict[str, Any]:
        m = self.members.get(name)
        if m is None or m.actor is None:
            known = ", ".join(self.members) or "none"
            raise ValueError(f"no running process {name!r} (processes: {known})")
        out = await members.get(m.actor.tail.remote(lines), CALL_TIMEOUT_S)
        return {**out, "node": m.node.get("ip", "")}

    async def down(self) -> dict[str, Any]:
        """Stop everything: routers first (clients see UNAVAILABLE rather than a router with
        no workers), then every worker, each drained (SIGTERM, then SIGKILL after
        `stop_grace_s`); actors and placement groups released. The names stopped."""
        self._stopping = True
        if self._loop is not None:
            self._loop.cancel()
        stopped = []
        for roles in (("router",), ROLES):
            batch = [m for m in self.members.values() if m.role in roles]
            await asyncio.gather(*(self._stop(m) for m in batch), return_exceptions=True)
            stopped += [m.name for m in batch]
        self._event(f"down: stopped {len(stopped)} processes")
        return {"stopped": stopped}

    # -- the reconcile loop ------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop is None and not self._stopping:
            self._wake = asyncio.Event()
            if self.spec.autoscale is not None:
                self._cadence = Cadence(self.spec.autoscale.period_s, time.monotonic())
            self._loop = asyncio.get_running_loop().create_task(self._run())

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — one bad round must not end reconciling
                log.exception("reconcile round failed")
                self._event(f"reconcile round failed: {type(exc).__name__}: {exc}")
            assert self._wake is not None
            try:
                await asyncio.wait_for(self._wake.wait(), self.spec.reconcile_period_s)
            except TimeoutError:
                pass
            self._wake.clear()

    async def _tick(self) -> None:
        await self._poll_ready()
        now = time.monotonic()
        if self._cadence is not None and self._cadence.due(now):
            await self._autoscale(now)
        loads = await self._surplus_loads()
        p = reconcile.plan(self.targets, [m.view() for m in self.members.values()], loads,
                           self.backoff.blocked(time.monotonic()))
        for name in p.reap:
            self._reap(self.members.pop(name))
        for name in p.drain:
            m = self.members[name]
            self._move(m, Phase.DRAINING)
            self._event(f"{name}: draining (surplus)")
            asyncio.get_running_loop().create_task(self._stop(m))
        for role, n in p.start.items():
            for _ in range(n):
                self._launch(role)

    async def _poll_ready(self) -> None:
        import ray

        ready = [m for m in self.members.values() if m.phase is Phase.READY]
        results = await asyncio.gather(*(members.get(m.actor.poll.remote(), CALL_TIMEOUT_S)
                                         for m in ready), return_exceptions=True)
        for m, r in zip(ready, results, strict=True):
            if m.phase is not Phase.READY:
                continue  # drained meanwhile
            if isinstance(r, ray.exceptions.ActorUnavailableError):
                continue  # transient (e.g. the network): look again next round
            if isinstance(r, ray.exceptions.RayActorError):
                self._lose(m, f"its actor died (node {m.node.get('ip', '?')} lost?): "
                              f"{members.first_line(r)}")
            elif isinstance(r, dict) and r.get("state") == "exited":
                self._lose(m, r.get("error", "exited"))

    def _lose(self, m: MemberState, why: str) -> None:
        self._move(m, Phase.LOST)
        m.error = why
        self._event(f"{m.name}: lost ({why.splitlines()[0]}); replacing it")
        log.warning("%s lost: %s", m.name, why)

    async def _autoscale(self, now: float) -> None:
        assert self._policy is not None and self._cadence is not None
        try:
            loads = {role: list((await self._loads(role)).values()) for role in ROLES}
            decision = self._policy.decide({r: self.targets[r] for r in ROLES}, loads,
                                           self._autoscale_state)
            self._autoscale_state = decision.state
            self._last_decision = describe(decision)
            for role, (before, target) in decision.changes().items():
                self.targets[role] = target
                self._event(f"autoscale {role}: {before} -> {target} "
                            f"({decision.reasons[role]})")
        except Exception as exc:  # noqa: BLE001 — the loop goes on
            self._event(f"autoscale: round failed ({type(exc).__name__}: {exc})")
        finally:
            self._cadence.done(now, time.monotonic())

    async def _surplus_loads(self) -> dict[str, WorkerLoad]:
        out: dict[str, WorkerLoad] = {}
        for role in ROLES:
            live = [m for m in self.members.values()
                    if m.role == role and m.phase in reconcile.LIVE]
            if len(live) > self.targets[role]:
                out.update(await self._loads(role))
        return out

    async def _loads(self, role: str) -> dict[str, WorkerLoad]:
        ready = [m for m in self.members.values() if m.role == role and m.phase is Phase.READY]
        results = await asyncio.gather(*(members.get(m.actor.stats.remote(), CALL_TIMEOUT_S)
                                         for m in ready), return_exceptions=True)
        return {m.name: WorkerLoad.from_stats(r) for m, r in zip(ready, results, strict=True)
                if isinstance(r, dict) and "error" not in r}

    # -- members -----------------------------------------------------------------------------
    def _launch(self, role: str) -> None:
        m = MemberState(f"{role}-{next(self._ids[role])}", role, next(self._serials))
        self.members[m.name] = m
        m.task = asyncio.get_running_loop().create_task(self._bring_up(m))

    async def _bring_up(self, m: MemberState) -> None:
        try:
            await members.place(m, self.spec)
            self._move(m, Phase.STARTING)
            await members.start(m, self.spec)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 — becomes the member's error
            if m.phase is Phase.DRAINING:
                return  # stopped on purpose while it started
            self._move(m, Phase.FAILED)
            m.error = members.describe(exc)
            wait = self.backoff.failed(m.role, time.monotonic())
            self.failures.append(m.error)
            self._event(f"{m.name}: start failed, retrying {m.role} in {wait:g}s: "
                        f"{m.error}")
            log.warning("%s: start failed: %s", m.name, m.error)
        else:
            if m.phase is Phase.STARTING:
                self._move(m, Phase.READY)
                self.backoff.succeeded(m.role)
                self._event(f"{m.name}: ready at {m.info.get('address', '?')} on "
                            f"{m.node.get('ip', '?')}")
        finally:
            self._poke()

    async def _stop(self, m: MemberState) -> None:
        """Drain one member: stop its process gracefully, then release what it holds."""
        if m.phase in reconcile.LIVE:
            self._move(m, Phase.DRAINING)
        if m.task is not None and not m.task.done() and m.actor is None:
            m.task.cancel()  # still placing: nothing runs yet
        if m.actor is not None:
            self._event(f"{m.name}: {await members.stop(m, self.spec.stop_grace_s)}")
        if m.task is not None and not m.task.done():
            m.task.cancel()
        members.release(m)
        self.members.pop(m.name, None)
        self._poke()

    def _reap(self, m: MemberState) -> None:
        """Release a dead member (its replacement is started by the same plan)."""
        if m.task is not None and not m.task.done():
            m.task.cancel()

        async def release() -> None:
            if m.actor is not None and m.phase is Phase.FAILED:
                await members.stop(m, 1.0)  # a failed start may leave a process behind
            members.release(m)

        asyncio.get_running_loop().create_task(release())

    def _move(self, m: MemberState, phase: Phase) -> None:
        reconcile.check_transition(m.phase, phase)
        m.phase, m.since = phase, time.monotonic()

    def _event(self, what: str) -> None:
        self.events.append(Event(at=round(time.time(), 3), what=what))
        log.info("%s", what)


_ROLE_ORDER = {"router": 0, "prefill": 1, "decode": 2}


def _log_to_stderr() -> None:
    import sys

    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
