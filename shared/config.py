"""One configuration model per service; file, environment and CLI flags derive from it.

A service declares a frozen ``msgspec.Struct`` whose fields carry their help text
in ``Annotated[T, Meta(description=...)]``. From that single declaration:

* a config file (TOML) may set any field, at top level or in a ``[<service>]`` table;
* the environment variable ``EI_<FIELD>`` (upper case) sets it;
* the CLI flag ``--<field-with-dashes>`` sets it (booleans get ``--x/--no-x``).

Precedence: default < file < environment < CLI. Values are validated by
msgspec once, at the end, so a bad value from any source is a clear error
naming the field (``ConfigError``), never a crash deep inside a service.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

T = TypeVar("T", bound=Struct)

ENV_PREFIX = "EI_"


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid."""


class CommonConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings every service process shares."""

    nats_url: typing.Annotated[str, Meta(description="NATS server URL, e.g. nats://127.0.0.1:4222; one with a password is, as a flag, in every local user's ps: set it in the environment")] = (
        "nats://127.0.0.1:4222"
    )
    nats_creds: typing.Annotated[
        str, Meta(description="NATS credentials of this identity: nkey seed file (SU...), .creds JWT file or user:password file; empty = none")
    ] = ""
    nats_user: typing.Annotated[str, Meta(description="NATS user (password auth; use EI_NATS_PASSWORD for the password)")] = ""
    nats_password: typing.Annotated[str, Meta(description="NATS password of nats_user (set it through the environment, not a flag)")] = ""
    nats_tls_ca: typing.Annotated[str, Meta(description="CA file to verify a TLS NATS server; empty = no TLS unless the URL is tls://")] = ""
    nats_tls_cert: typing.Annotated[str, Meta(description="client certificate for NATS TLS (with nats_tls_key)")] = ""
    nats_tls_key: typing.Annotated[str, Meta(description="client key for NATS TLS")] = ""
    partition: typing.Annotated[str, Meta(description="partition name; every subject lives under ei.<partition>.")] = "p0"
    instance: typing.Annotated[str, Meta(description="instance id of this process (default: derived from the service)")] = ""
    log_format: typing.Annotated[
        Literal["console", "json"], Meta(description="console for humans, json for machines (one JSON object per line, libraries' lines too)")
    ] = "console"
    log_level: typing.Annotated[str, Meta(description="debug, info, warning or error")] = "info"
    speedup: typing.Annotated[
        float, Meta(gt=0, description="simulated seconds per wall second (sim engine, clocks; a torch engine's measured times x this)")
    ] = 1.0
    clock_origin: typing.Annotated[
        float, Meta(ge=0, description="wall time (epoch s) that is simulated time 0; 0 = process start")
    ] = 0.0
    metrics_port: typing.Annotated[
        int, Meta(ge=0, le=65535, description="serve Prometheus GET /metrics on this TCP port; 0 = off")
    ] = 0
    metrics_host: typing.Annotated[
        str, Meta(description="bind address of the metrics port (0.0.0.0 inside a container)")
    ] = "127.0.0.1"
    metrics_fd: typing.Annotated[
        int,
        Meta(ge=-1, description="serve the metrics endpoints on this inherited listening TCP socket (a file descriptor) "
             "instead of binding --metrics-host/--metrics-port: a supervisor that chose the port holds it from its choice "
             "on, across the service's restarts (evolving-infra up --metrics does), so no other process takes it in "
             "between; -1 = bind --metrics-port"),
    ] = -1
    otlp_traces_endpoint: typing.Annotated[
        str,
        Meta(
            pattern=r"^(https?://\S+)?$",
            description="export OpenTelemetry traces over OTLP/HTTP (protobuf) to this collector, e.g. "
            "http://127.0.0.1:4318 (/v1/traces is appended unless the URL ends with it); empty = the standard "
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, unset = no tracing; other "
            "OTEL_EXPORTER_OTLP_* variables (headers, timeout), OTEL_TRACES_SAMPLER(_ARG) and OTEL_SDK_DISABLED=true "
            "apply; service.name is always evolving-infra-<service> (OTEL_SERVICE_NAME is ignored, "
            "OTEL_RESOURCE_ATTRIBUTES kept); vLLM's --otlp-traces-endpoint",
        ),
    ] = ""


def _field_infos(cls: type[Struct]) -> list[msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return list(info.fields)


def _description(field: msgspec.inspect.Field) -> str:
    t = field.type
    if isinstance(t, msgspec.inspect.Metadata):
        return str(t.extra_json_schema.get("description", "")) if t.extra_json_schema else ""
    return ""


def _base_type(cls: type[Struct], name: str) -> Any:
    hints = typing.get_type_hints(cls, include_extras=False)
    return hints[name]


def _is_bool(tp: Any) -> bool:
    return tp is bool


def _choices(tp: Any) -> list[str] | None:
    if typing.get_origin(tp) is Literal:
        return [str(a) for a in typing.get_args(tp)]
    return None


def _from_text(tp: Any, text: str) -> Any:
    """Turn an environment or CLI string into a value msgspec can validate."""
    if not isinstance(text, str):
        return text
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return [s for s in (p.strip() for p in text.split(",")) if s]
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
        if text.lower() in ("", "none", "null"):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from_text(inner[0], text) if len(inner) == 1 else text
    if tp is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"not a boolean: {text!r}")
    return text


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type[Struct]) -> None:
    """Add one flag per config field to ``parser`` (defaults are left unset so
    that file and environment values are not overridden by them)."""
    fields = _field_infos(cls)
    for f in fields:
        tp = _base_type(cls, f.name)
        desc = _description(f)
        # a list field's default is a factory (msgspec keeps ``= []`` and ``field(default_factory=...)`` so):
        # --help said "default None" for the router's --api-key-public-paths, whose default is 4 paths
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = None
        if isinstance(default, (list, tuple)):  # as the flag and EI_* variable take it: comma-separated
            default = ",".join(str(v) for v in default)
        # argparse formats help with %: a description's own % ('cuda:{i % visible devices}') crashed --help
        help_text = f"{desc} (env {env_name(f.name)}; default {default!r})".replace("%", "%%")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if _is_bool(tp):
            parser.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **kw)
            continue
        choices = _choices(tp)
        if choices:
            kw["choices"] = choices
        parser.add_argument(flag_name(f.name), metavar=f.name.upper(), **kw)


def load_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    section: str | None = None,
    prog: str | None = None,
    description: str | None = None,
    env: dict[str, str] | None = None,
) -> T:
    """Build ``cls`` from defaults, ``--config FILE``, ``EI_*`` variables and flags.

    Args:
        cls: the service's config Struct.
        argv: CLI arguments (default ``sys.argv[1:]``).
        section: TOML table to read besides the top level (default: ``prog``).
        env: environment mapping (default ``os.environ``).

    Raises:
        ConfigError: on an unknown key in the file, or a value that fails validation.
        SystemExit: from argparse on ``--help`` or a malformed flag.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below")
    add_arguments(parser, cls)
    ns = parser.parse_args(argv)
    return resolve_config(cls, vars(ns), section=section or prog, env=env)


def resolve_config(
    cls: type[T],
    cli_values: dict[str, Any],
    *,
    section: str | None = None,
    env: dict[str, str] | None = None,
) -> T:
    """Merge file (``cli_values['config']``), environment and CLI values into ``cls``.

    Raises:
        ConfigError: on an unknown file key or an invalid value.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    names = set(cls.__struct_fields__)  # (msgspec.inspect.type_info resolved every field's type for its name)
    values: dict[str, Any] = {}
    config_file = cli_values.get("config")
    if config_file:
        try:
            data = tomllib.loads(Path(config_file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config file {config_file}: {e}") from e
        for key, val in data.items():
            if isinstance(val, dict):
                if section and key == section:
                    for k2, v2 in val.items():
                        k2 = k2.replace("-", "_")
                        if k2 not in names:
                            raise ConfigError(f"{config_file}: unknown setting [{key}].{k2}")
                        values[k2] = v2
                continue
            key = key.replace("-", "_")
            if key in names:
                values[key] = val
    for name in names:
        text = environ.get(env_name(name))
        if text is not None:
            values[name] = _from_text(_base_type(cls, name), text)
    for name in names:
        if name in cli_values:
            values[name] = _from_text(_base_type(cls, name), cli_values[name])
    try:
        return msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid configuration: {e}") from e


def field_from_text(cls: type[Struct], name: str, text: str) -> Any:
    """Field ``name`` of ``cls`` from one environment or flag string ``text``, as :func:`resolve_config` takes it:
    the same accepted values, the same value, the same error (``invalid configuration: ... - at `$.<name>```).
    For a program that reads one service setting without building the service's whole config (``up`` checking
    the ``EI_KV_POOL_MAX_BYTES`` its workers will inherit).

    Raises:
        ConfigError: ``name`` is not a field of ``cls``, or ``text`` fails its type or constraints.
    """
    hints = typing.get_type_hints(cls, include_extras=True)
    if name not in hints or name not in cls.__struct_fields__:
        raise ConfigError(f"{cls.__name__} has no setting {name!r}")
    one = msgspec.defstruct(cls.__name__, [(name, hints[name])])
    try:
        return getattr(msgspec.convert({name: _from_text(_base_type(cls, name), text)}, one, strict=False), name)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid configuration: {e}") from e


def to_argv(cfg: Struct, *, skip_defaults: bool = True) -> list[str]:
    """CLI flags that reproduce ``cfg``: ``load_config(type(cfg), to_argv(cfg))`` gives it back
    (for a program that starts a service with a given configuration).

    With ``skip_defaults``, a field equal to its default is left out, a list field's default
    included (msgspec keeps ``= []`` and ``field(default_factory=...)`` as a factory, called
    here once per such field)."""
    out: list[str] = []
    for f in _field_infos(type(cfg)):
        value = getattr(cfg, f.name)
        if skip_defaults:
            if f.default is not msgspec.NODEFAULT:
                if value == f.default:
                    continue
            elif f.default_factory is not msgspec.NODEFAULT and value == f.default_factory():
                continue
        if isinstance(value, bool):
            out.append(flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            out += [flag_name(f.name), ",".join(str(v) for v in value)]
        elif value is None:
            out += [flag_name(f.name), "none"]
        else:
            out += [flag_name(f.name), str(value)]
    return out


def parse_key_values(items: Sequence[str], what: str = "argument") -> dict[str, Any]:
    """``["t_learn_s=60", "slo-guard=false"]`` → ``{"t_learn_s": 60, "slo_guard": False}``: free-form
    options of a pluggable component (a planner's or router's parameters), keys with ``-``
    read as ``_``.

    Values: ``true/yes/on`` / ``false/no/off`` → bool, ``none/null`` → None, ints, floats,
    else the string.

    Raises:
        ValueError: an item without ``=`` or with an empty key (the message names ``what``).
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"{what} {item!r} must look like key=value")
        v = raw.strip()
        low = v.lower()
        val: Any
        if low in ("true", "yes", "on"):
            val = True
        elif low in ("false", "no", "off"):
            val = False
        elif low in ("none", "null"):
            val = None
        else:
            try:
                val = int(v)
            except ValueError:
                try:
                    val = float(v)
                except ValueError:
                    val = v
        out[key] = val
    return out
