"""``up``/``demo``: the KV directory's ``--kv-stale-after-s`` must exceed the workers' ``--kv-alive-interval-s``.

A serving worker that stores no block (a long decode) sends an empty KV batch every ``--kv-alive-interval-s`` (1 s)
and nothing between; the directory calls a node's view stale after ``--kv-stale-after-s`` (10 s) without a batch. At or
below the interval a healthy decoding node was called stale between two alive batches (left out of lookups, a needless
resync), and nothing checked the relation. ``up`` sets neither flag: each service reads its own from the environment
it inherits (``EI_KV_STALE_AFTER_S``, ``EI_KV_ALIVE_INTERVAL_S``), so ``up`` reads both there, with each service's own
config, and refuses the pair before anything starts. ``deploy-args`` prints neither (each host its own environment).
"""

from __future__ import annotations

import pytest

from evolving_infra.cli import UsageError, build_parser
from evolving_infra.launcher import _spec, kv_liveness_times
from services.kvdirectory.config import DirectoryConfig
from services.worker.config import WorkerConfig
from shared.config import ConfigError, resolve_config

BOTH = r"--kv-stale-after-s \(EI_KV_STALE_AFTER_S\) is {stale} s, not more than the workers' --kv-alive-interval-s \(EI_KV_ALIVE_INTERVAL_S\) {alive} s"


def test_unset_both_are_the_services_defaults():
    assert kv_liveness_times({}) == (
        resolve_config(DirectoryConfig, {}, env={}).kv_stale_after_s, resolve_config(WorkerConfig, {}, env={}).kv_alive_interval_s
    ) == (10.0, 1.0)


@pytest.mark.parametrize(("env", "stale", "alive"), [
    ({"EI_KV_STALE_AFTER_S": "1"}, "1", "1"),  # equal: stale between two batches
    ({"EI_KV_STALE_AFTER_S": "0.5"}, "0.5", "1"),
    ({"EI_KV_ALIVE_INTERVAL_S": "12"}, "10", "12"),
    ({"EI_KV_STALE_AFTER_S": "3", "EI_KV_ALIVE_INTERVAL_S": "3.0"}, "3", "3"),
])  # fmt: skip
def test_a_stale_after_not_above_the_alive_interval_is_refused_naming_both_flags(env, stale, alive):
    with pytest.raises(UsageError, match="^error: the KV directory's " + BOTH.format(stale=stale, alive=alive)) as e:
        kv_liveness_times(env)
    assert "\n" not in str(e.value)


def test_the_refusal_says_what_to_set_by_the_variables_up_and_demo_pass_on(capsys):
    """``up``/``demo`` have no ``--kv-stale-after-s`` or ``--kv-alive-interval-s`` (the services read them from the
    environment): the advice names the variables and the services' defaults, not flags the command would reject."""
    with pytest.raises(UsageError) as e:
        kv_liveness_times({"EI_KV_STALE_AFTER_S": "1"})
    defaults = (resolve_config(DirectoryConfig, {}, env={}).kv_stale_after_s, resolve_config(WorkerConfig, {}, env={}).kv_alive_interval_s)
    assert str(e.value).endswith(
        f"; set EI_KV_STALE_AFTER_S to a few times EI_KV_ALIVE_INTERVAL_S (defaults {defaults[0]:g} and {defaults[1]:g})"
    ), str(e.value)
    assert defaults == (10.0, 1.0)
    for command in ("up", "demo"):  # what the old advice said to give: neither command has it
        for flag in ("--kv-stale-after-s", "--kv-alive-interval-s"):
            with pytest.raises(SystemExit):
                build_parser(command).parse_args([command, flag, "5"])
            assert f"unrecognized arguments: {flag} 5" in capsys.readouterr().err


@pytest.mark.parametrize("env", [{"EI_KV_STALE_AFTER_S": "0.5", "EI_KV_ALIVE_INTERVAL_S": "0.1"}, {"EI_KV_STALE_AFTER_S": "1.5"}])
def test_a_stale_after_above_the_alive_interval_is_taken(env):
    assert kv_liveness_times(env) == (float(env["EI_KV_STALE_AFTER_S"]), float(env.get("EI_KV_ALIVE_INTERVAL_S", 1.0)))


@pytest.mark.parametrize("env", [
    {"EI_KV_STALE_AFTER_S": "inf", "EI_KV_ALIVE_INTERVAL_S": "inf"},  # staleness off, alive batches off
    {"EI_KV_STALE_AFTER_S": "inf"}, {"EI_KV_STALE_AFTER_S": "inf", "EI_KV_ALIVE_INTERVAL_S": "1e300"},
])  # fmt: skip
def test_an_infinite_stale_after_is_taken_whatever_the_interval(env):
    """Both services take ``inf`` (the directory then calls no view stale): no interval makes a healthy node stale."""
    for cls, name in ((DirectoryConfig, "kv_stale_after_s"), (WorkerConfig, "kv_alive_interval_s")):
        var = "EI_" + name.upper()
        if var in env:
            assert getattr(resolve_config(cls, {}, env={var: env[var]}), name) == float(env[var])
    assert kv_liveness_times(env) == (float("inf"), float(env.get("EI_KV_ALIVE_INTERVAL_S", 1.0)))


@pytest.mark.parametrize(("cls", "name", "who"), [
    (DirectoryConfig, "kv_stale_after_s", "the KV directory"), (WorkerConfig, "kv_alive_interval_s", "every worker"),
])  # fmt: skip
@pytest.mark.parametrize("text", ["x", "0", "-1", "", "inf", "nan", "2.5", "0.001"])
def test_each_is_read_as_its_service_reads_it(cls, name, who, text):
    """What the service refuses is refused with its message; what it takes is the same number."""
    var = "EI_" + name.upper()
    try:
        service: float | str = getattr(resolve_config(cls, {}, env={var: text}), name)
    except ConfigError as e:
        service = str(e)
    try:
        stale, alive = kv_liveness_times({var: text})
    except UsageError as e:
        if isinstance(service, str):
            assert str(e) == f"error: {var}={text!r}: {service} ({who} inherits it)"
        else:  # taken, but not above the other's default
            assert "not more than" in str(e), (text, str(e))
    else:
        assert service == (stale if cls is DirectoryConfig else alive), text


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_and_demo_refuse_it_before_the_start_and_deploy_args_leaves_it(command, tmp_path, monkeypatch):
    args = build_parser(command).parse_args([command, "--log-dir", str(tmp_path)])
    assert _spec(args) is not None
    monkeypatch.setenv("EI_KV_STALE_AFTER_S", "1")
    with pytest.raises(UsageError, match=BOTH.format(stale="1", alive="1")):
        _spec(args)
    assert _spec(args, one_host=False) is not None  # deploy-args: the services' hosts have their own environment
    monkeypatch.setenv("EI_KV_ALIVE_INTERVAL_S", "0.25")
    assert _spec(args) is not None
    monkeypatch.setenv("EI_KV_STALE_AFTER_S", "inf")
    monkeypatch.setenv("EI_KV_ALIVE_INTERVAL_S", "inf")
    assert _spec(args) is not None
