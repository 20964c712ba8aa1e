"""``up`` stopped (SIGINT/SIGTERM) during its start: ``LocalCluster.start``'s clean-up, its stop of what it started
(up to 10 s for the services to exit, then SIGKILL, then NATS), runs to its end before ``up`` exits.

``shared.service.until_stopped`` cancels the start; 0277de5 made it cancel again every 0.05 s, which cut that stop
short at its first await: services and the embedded nats-server left running, their log files open. Now ``up`` and
``demo`` give the start ``CLUSTER_STOP_GRACE_S`` before a second cancel."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from shared.service import STOP_GRACE_S


@pytest.mark.timeout(60)
async def test_up_stopped_during_start_up_lets_the_cluster_stop_finish(monkeypatch):
    from evolving_infra import launcher

    events: list[str] = []

    class SlowToStopCluster:  # LocalCluster's start/stop shape; its stop longer than until_stopped's default grace
        def __init__(self, spec):
            pass

        async def start(self) -> None:
            try:
                await asyncio.sleep(3600)  # e.g. waiting for the services to be healthy
            except BaseException:
                await self.stop()
                raise

        async def stop(self) -> None:
            events.append("stopping")
            await asyncio.sleep(STOP_GRACE_S + 0.5)  # services slow to exit on a loaded machine
            events.append("stopped")

        def remove_generated_creds(self, **_kw) -> None:
            events.append("creds removed")

    def stop_soon(stop: asyncio.Event) -> list[int]:  # the signal, 0.1 s into the start
        asyncio.get_running_loop().call_later(0.1, stop.set)
        return []

    monkeypatch.setattr(launcher, "_spec", lambda args: None)
    monkeypatch.setattr(launcher, "port_unavailable", lambda host, port: None)
    monkeypatch.setattr(launcher, "LocalCluster", SlowToStopCluster)
    monkeypatch.setattr(launcher, "_stop_on_signals", stop_soon)
    assert launcher.CLUSTER_STOP_GRACE_S > 10.0  # LocalCluster.stop's own wait for its services
    status = await launcher._up(argparse.Namespace(host="127.0.0.1", port=0, log_dir=None))
    assert status == 0
    assert events == ["stopping", "stopped", "creds removed"], events


@pytest.mark.timeout(60)
async def test_up_stops_a_cluster_whose_start_finished_despite_its_cancel(monkeypatch):
    """The start's one cancel lost (a nats-py ``wait_for`` answered it with its reply) and the start then finished
    within the grace: before, its result was dropped, ``up`` printed "stopped during start-up" and returned 0
    without ``cluster.stop()``, its services and nats-server left running (/tmp/rr-h/a2.py)."""
    from evolving_infra import launcher

    events: list[str] = []

    class LostCancelCluster:
        def __init__(self, spec):
            pass

        async def start(self) -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # stands for the cancel a wait_for swallowed
            await asyncio.sleep(0.2)
            events.append("started")

        async def stop(self) -> None:
            events.append("stopped")

        def remove_generated_creds(self, **_kw) -> None:
            events.append("creds removed")

    def stop_soon(stop: asyncio.Event) -> list[int]:
        asyncio.get_running_loop().call_later(0.1, stop.set)
        return []

    monkeypatch.setattr(launcher, "_spec", lambda args: None)
    monkeypatch.setattr(launcher, "port_unavailable", lambda host, port: None)
    monkeypatch.setattr(launcher, "LocalCluster", LostCancelCluster)
    monkeypatch.setattr(launcher, "_stop_on_signals", stop_soon)
    status = await launcher._up(argparse.Namespace(host="127.0.0.1", port=0, log_dir=None))
    assert status == 0
    assert events == ["started", "stopped", "creds removed"], events
