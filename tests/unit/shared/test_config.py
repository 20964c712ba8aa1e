from typing import Annotated, Literal

import msgspec
import pytest
from msgspec import Meta

from shared.config import CommonConfig, ConfigError, env_name, field_from_text, load_config, resolve_config, to_argv


class DemoConfig(CommonConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    nodes: Annotated[int, Meta(ge=1, description="number of nodes")] = 4
    mode: Annotated[Literal["a", "b"], Meta(description="mode")] = "a"
    fast: Annotated[bool, Meta(description="go fast")] = False
    names: Annotated[list[str], Meta(description="names")] = []


def test_precedence_default_file_env_cli(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('nodes = 2\nmode = "b"\n[demo]\nfast = true\n')
    cfg = load_config(DemoConfig, ["--config", str(f)], prog="demo", env={})
    assert (cfg.nodes, cfg.mode, cfg.fast) == (2, "b", True)
    cfg = load_config(DemoConfig, ["--config", str(f)], prog="demo", env={"EI_NODES": "6"})
    assert cfg.nodes == 6
    cfg = load_config(DemoConfig, ["--config", str(f), "--nodes", "9", "--no-fast", "--names", "x,y"], prog="demo", env={"EI_NODES": "6"})
    assert (cfg.nodes, cfg.fast, cfg.names) == (9, False, ["x", "y"])


def test_bad_values_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="nodes"):
        load_config(DemoConfig, ["--nodes", "0"], env={})
    with pytest.raises(ConfigError, match="nodes"):
        load_config(DemoConfig, [], env={"EI_NODES": "many"})
    f = tmp_path / "c.toml"
    f.write_text("[demo]\nbogus = 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        load_config(DemoConfig, ["--config", str(f)], prog="demo", env={})
    with pytest.raises(SystemExit):
        load_config(DemoConfig, ["--mode", "c"], env={})


def test_to_argv_roundtrip():
    cfg = DemoConfig(nodes=3, fast=True, names=["a"], speedup=10.0)
    again = load_config(DemoConfig, to_argv(cfg), env={})
    assert msgspec.structs.asdict(again) == msgspec.structs.asdict(cfg)


def test_to_argv_leaves_out_list_defaults():
    # a list field left at its default (kept by msgspec as a factory) is not spelled out
    assert to_argv(DemoConfig()) == []
    assert to_argv(DemoConfig(names=["a", "b"])) == ["--names", "a,b"]
    assert "--names" in to_argv(DemoConfig(), skip_defaults=False)


def test_help_shows_list_defaults_as_the_flag_takes_them():
    """A list field's default comes from a factory: --help said "default None" (the router's
    --api-key-public-paths, whose default is /livez,/healthz,/health,/ping,/metrics)."""
    import argparse

    from shared.config import add_arguments

    class Paths(CommonConfig, frozen=True, kw_only=True):
        paths: Annotated[list[str], Meta(description="paths")] = msgspec.field(default_factory=lambda: ["/a", "/b"])
        empty: Annotated[list[str], Meta(description="empty")] = msgspec.field(default_factory=list)

    parser = argparse.ArgumentParser()
    add_arguments(parser, Paths)
    text = " ".join(parser.format_help().split())
    assert "default '/a,/b'" in text and "default ''" in text and "default None" not in text


@pytest.mark.parametrize(
    ("name", "text"),
    [("metrics_port", "9100"), ("metrics_port", "70000"), ("metrics_port", "-1"), ("metrics_port", "x"), ("metrics_port", "1e2"),
     ("speedup", "2.5"), ("speedup", "fast"), ("log_level", "debug"), ("log_level", "loud"),
     ("otlp_traces_endpoint", "http://c:4318"), ("otlp_traces_endpoint", "ftp://c")],
)  # fmt: skip
def test_one_field_from_text_is_what_the_whole_config_makes_of_it(name, text):
    """``field_from_text`` takes a value as ``resolve_config`` does from ``EI_<NAME>``: the same value, or the same error."""
    try:
        whole = getattr(resolve_config(CommonConfig, {}, env={env_name(name): text}), name)
    except ConfigError as e:
        with pytest.raises(ConfigError) as one:
            field_from_text(CommonConfig, name, text)
        assert str(one.value) == str(e)
    else:
        assert field_from_text(CommonConfig, name, text) == whole


def test_field_from_text_refuses_a_name_that_is_no_field():
    with pytest.raises(ConfigError, match="CommonConfig has no setting 'metrics_prot'"):
        field_from_text(CommonConfig, "metrics_prot", "1")
