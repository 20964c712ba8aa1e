"""``up``/``demo --kv-pool real``: the workers' real-bytes host KV pool from the launcher (session 46, fifth fault walk).

``LocalCluster`` could give workers ``--kv-pool real`` (``ClusterSpec.worker_args``; the torch live test does), but
``up`` had no flag for it, so ``bench/faults.py`` could not run a cluster whose workers move KV bytes. Now
``--kv-pool real`` gives every worker ``--kv-pool real`` (and ``--kv-pool-slot-bytes``) and its own range of Mooncake
ports (``--kv-pool-ports``, 32 ports, disjoint: two workers drawing from Mooncake's 15000-17000 at random may take the same
port), the same after a restart (the flags are the child's command line). A pool that would not fit, or no Mooncake, is
refused before anything starts (the workers would exit 2 one by one); ``deploy-args`` refuses it (its flags carry no
worker extras: it would drop it).
"""

from __future__ import annotations

import importlib.util

import pytest

from evolving_infra.cli import UsageError, build_parser
from evolving_infra.cluster import LocalCluster
from evolving_infra.launcher import KV_POOL_PORTS_PER_WORKER, _spec, kv_pool_max_bytes
from services.worker.config import WorkerConfig
from services.worker.kvpool.config import DEFAULT_MAX_POOL_BYTES, parse_port_range
from shared.config import ConfigError, load_config, resolve_config


@pytest.fixture
def mooncake_found(monkeypatch):
    """``find_spec("mooncake")`` answers as where it is installed (these tests run without it too)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "mooncake" else real(name, *a))


def _workers(command: str, tmp_path, *flags: str) -> dict[str, list[str]]:
    args = build_parser(command).parse_args([command, "--log-dir", str(tmp_path), *flags])
    kids = LocalCluster(_spec(args))._plan_children()
    return {k.name: k.argv[k.argv.index("-m") + 2 :] for k in kids if k.name.startswith("worker-")}


@pytest.mark.parametrize("command", ["up", "demo"])
def test_kv_pool_real_reaches_every_worker_with_its_own_port_range(command, tmp_path, mooncake_found):
    workers = _workers(command, tmp_path, "--kv-pool", "real", "--kv-pool-slot-bytes", "4096")
    assert sorted(workers) == ["worker-w0", "worker-w1", "worker-w2", "worker-w3"]
    ranges = []
    for name, argv in workers.items():
        cfg = load_config(WorkerConfig, argv, prog="worker", env={})
        assert (cfg.kv_pool, cfg.kv_pool_slot_bytes) == ("real", 4096), name
        assert argv.count("--kv-pool-ports") == 1
        ranges.append(parse_port_range(cfg.kv_pool_ports))
        lo, hi = ranges[-1]
        assert hi - lo + 1 == KV_POOL_PORTS_PER_WORKER == 32  # room for a restart beside its predecessor's TIME_WAIT ports
    for i, (lo, hi) in enumerate(ranges):  # no port shared by two workers
        assert all(hi < a or lo > b for a, b in ranges[:i]), ranges


def test_without_the_flag_no_worker_gets_a_pool(tmp_path):
    for argv in _workers("up", tmp_path).values():
        assert not any(a.startswith("--kv-pool") for a in argv)
        assert load_config(WorkerConfig, argv, prog="worker", env={}).kv_pool == "off"


def test_a_pool_over_its_limit_is_refused_before_the_start_naming_the_knobs(tmp_path, mooncake_found):
    args = build_parser("up").parse_args(["up", "--log-dir", str(tmp_path), "--kv-pool", "real"])  # gb300: 7.9 GiB at 64 KiB
    with pytest.raises(UsageError, match=r"--kv-pool real: real-bytes pool of 128750 host blocks .*--kv-pool-slot-bytes N"):
        _spec(args)


def test_without_mooncake_it_is_refused_naming_the_install_script(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mooncake" else real(name, *a))
    args = build_parser("up").parse_args(["up", "--log-dir", str(tmp_path), "--kv-pool", "real", "--kv-pool-slot-bytes", "4096"])
    with pytest.raises(UsageError, match="scripts/install-mooncake.sh"):
        _spec(args)


def test_deploy_args_refuse_it_rather_than_drop_it(mooncake_found):
    args = build_parser("up").parse_args(["up", "--kv-pool", "real", "--kv-pool-slot-bytes", "4096"])
    with pytest.raises(UsageError, match="deploy-args does not support --kv-pool real.*give each worker --kv-pool real "
                                         "and its own --kv-pool-ports"):
        _spec(args, one_host=False)


def test_the_limit_is_the_one_the_workers_read_from_the_environment(tmp_path, mooncake_found, monkeypatch):
    """The refusal says "raise the limit"; for ``up`` that is ``EI_KV_POOL_MAX_BYTES``, which every worker it starts
    inherits. Before, ``up`` checked the pool against the 1 GiB default whatever the variable said (refused, exit 2,
    a pool its workers would have taken) and its message named no way to raise the limit."""
    args = build_parser("up").parse_args(["up", "--log-dir", str(tmp_path), "--kv-pool", "real"])  # gb300: 7.86 GiB
    with pytest.raises(UsageError, match=r"or EI_KV_POOL_MAX_BYTES"):
        _spec(args)
    monkeypatch.setenv("EI_KV_POOL_MAX_BYTES", str(8 * 2**30))
    assert _spec(args) is not None  # 7.86 GiB <= 8 GiB: started, each worker with --kv-pool real and its ports
    monkeypatch.setenv("EI_KV_POOL_MAX_BYTES", "lots")
    with pytest.raises(UsageError, match=r"EI_KV_POOL_MAX_BYTES='lots': invalid configuration: Expected `int`, got `str`"):
        _spec(args)


# what a user may write, and what the worker's config made of it: up's own int(text) > 0 took ' 5 ', '+7' and '1_000'
# (every worker then exited 2) and refused '1e3' and '1.0' (which the workers take), and took '' as unset
LIMIT_TEXTS = ["1GiB", "0", "-1", "x", "", " 5 ", "+7", "1_000", "1e3", "1.0", "0x10", "4096", str(8 * 2**30)]


@pytest.mark.parametrize("text", LIMIT_TEXTS)
def test_up_reads_the_limit_as_the_worker_does(text):
    """``up`` parses ``EI_KV_POOL_MAX_BYTES`` with the worker's config (shared.config.field_from_text on
    ``WorkerConfig.kv_pool_max_bytes``): it takes what every worker takes, as the same number, and refuses what
    they refuse, with their message."""
    env = {"EI_KV_POOL_MAX_BYTES": text}
    try:
        worker: int | str = resolve_config(WorkerConfig, {}, env=env).kv_pool_max_bytes
    except ConfigError as e:
        worker = str(e)
    try:
        up: int | str = kv_pool_max_bytes(env)
    except UsageError as e:
        assert isinstance(worker, str), (text, worker, str(e))
        assert str(e) == f"error: EI_KV_POOL_MAX_BYTES={text!r}: {worker} (every worker inherits it)"
    else:
        assert up == worker, text


def test_unset_the_limit_is_the_workers_default():
    assert kv_pool_max_bytes({}) == resolve_config(WorkerConfig, {}, env={}).kv_pool_max_bytes == DEFAULT_MAX_POOL_BYTES


def test_deploy_args_say_they_do_not_support_it_before_looking_for_mooncake_here(monkeypatch):
    """The host running deploy-args need not have Mooncake: the workers' hosts do."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mooncake" else real(name, *a))
    args = build_parser("up").parse_args(["up", "--kv-pool", "real", "--kv-pool-slot-bytes", "4096"])
    with pytest.raises(UsageError, match="deploy-args does not support --kv-pool real"):
        _spec(args, one_host=False)


def test_slot_bytes_without_the_real_pool_is_refused_not_dropped(tmp_path):
    args = build_parser("up").parse_args(["up", "--log-dir", str(tmp_path), "--kv-pool-slot-bytes", "4096"])
    with pytest.raises(UsageError, match="--kv-pool-slot-bytes 4096 sizes the real-bytes pool: give --kv-pool real"):
        _spec(args)


@pytest.mark.timeout(60)
def test_hundreds_of_workers_get_disjoint_ranges_at_once_and_too_many_a_usage_error(mooncake_found, monkeypatch):
    """Drawing random 32-port ranges until none overlapped never ended at ~300+ workers (review: 400 nodes looped
    40 s): the ranges are taken in order from a random one, so the search ends, and past what the port space holds
    (399 ranges of 32 in 20000-32767) up says so."""
    import argparse

    from evolving_infra.cluster import ClusterSpec
    from evolving_infra.launcher import _kv_pool_values
    from services.worker.kvpool import transport

    monkeypatch.setattr(transport, "_free", lambda lo, width: True)  # a quiet host: every port free
    spec = ClusterSpec(profile="tiny")
    for n in (8, 399):
        args = argparse.Namespace(kv_pool="real", kv_pool_slot_bytes=256, engine="sim", nodes=n)
        ranges = [parse_port_range(v[1]) for v in _kv_pool_values(args, spec, one_host=True)["node_args"].values()]
        assert len(ranges) == n and all(hi - lo + 1 == KV_POOL_PORTS_PER_WORKER for lo, hi in ranges)
        assert len({p for lo, hi in ranges for p in range(lo, hi + 1)}) == n * KV_POOL_PORTS_PER_WORKER  # disjoint
    args = argparse.Namespace(kv_pool="real", kv_pool_slot_bytes=256, engine="sim", nodes=400)
    with pytest.raises(UsageError, match=r"--nodes 400: each worker needs 32 Mooncake ports.*run fewer workers"):
        _kv_pool_values(args, spec, one_host=True)
    monkeypatch.setattr(transport, "_free", lambda lo, width: lo % 64 == 0)  # a busy host: about half taken
    args = argparse.Namespace(kv_pool="real", kv_pool_slot_bytes=256, engine="sim", nodes=300)
    with pytest.raises(UsageError, match=r"only \d+ of 300 ranges of 32 free TCP ports"):
        _kv_pool_values(args, spec, one_host=True)


@pytest.mark.parametrize("command", ["up", "demo"])
def test_a_bad_limit_is_refused_without_the_pool_too(command, tmp_path, monkeypatch):
    """Every worker reads ``EI_KV_POOL_MAX_BYTES`` from the environment it inherits, with the pool off too: a value
    they refuse killed each worker at start (exit 2, in its own log). ``up`` checked it only with ``--kv-pool real``;
    now always, with the worker's parser and message. ``deploy-args`` leaves it (its workers run elsewhere, in
    another environment)."""
    args = build_parser(command).parse_args([command, "--log-dir", str(tmp_path)])
    monkeypatch.setenv("EI_KV_POOL_MAX_BYTES", "0")
    with pytest.raises(ConfigError):  # what each worker does with it
        resolve_config(WorkerConfig, {}, env={"EI_KV_POOL_MAX_BYTES": "0"})
    with pytest.raises(UsageError, match=r"^error: EI_KV_POOL_MAX_BYTES='0': invalid configuration: Expected `int` >= 1 "
                                         r".*\(every worker inherits it\)$"):
        _spec(args)
    assert _spec(args, one_host=False) is not None
    monkeypatch.setenv("EI_KV_POOL_MAX_BYTES", "4096")
    assert _spec(args) is not None
