"""Hardware/model profiles: the numbers a simulated GPU node runs on (DESIGN §5).

A profile is a TOML file (shipped ones live in ``shared/profiles/``) holding the
Eq. 1/2 coefficients, KV bytes per token, L1/L2 capacities, link bandwidths and
scheduler limits of one node. Shipped profiles write their derivation in
comments. Load one with :func:`load_profile` by name (``gb300-glm52``) or path.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from shared.itermodel import DecodeModel, PrefillModel

PROFILE_DIR = Path(__file__).parent / "profiles"

ProfileClock = Literal["cluster", "wall"]
"""What a profile's times are: ``cluster`` seconds (a sim engine's profile: its durations are simulated, and
``--speedup`` only sets how fast they pass) or ``wall`` seconds measured at speed-up 1 (a real engine's,
``--engine torch``: :func:`on_cluster_clock` puts them on the cluster clock)."""

Pos = Annotated[float, Meta(gt=0)]
PosInt = Annotated[int, Meta(gt=0)]


class MemoryProfile(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    gpu_kv_tokens: PosInt
    """L1: tokens of KV that fit in the node's GPU memory (all GPUs of the node)."""
    host_kv_tokens: PosInt
    """L2: tokens of KV that fit in the node's host memory (one deduplicated copy)."""


class LinkProfile(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    gpu_to_gpu_bytes_per_s: Pos
    """Prefill → decode KV transfer bandwidth (bytes/s)."""
    gpu_to_gpu_latency_s: Annotated[float, Meta(ge=0)] = 0.0
    peer_fetch_bytes_per_s: Pos = 52e9
    """Peer L2 → local L2 fetch bandwidth over RDMA (bytes/s), shared by concurrent fetches."""
    peer_fetch_latency_s: Annotated[float, Meta(ge=0)] = 0.0
    host_to_gpu_bytes_per_s: Pos = 50e9
    """Local L2 → L1 restore bandwidth (bytes/s)."""


class SchedulerProfile(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    chunk_tokens: PosInt = 8192
    """Token budget of one prefill iteration (chunked prefill)."""
    max_running: PosInt = 64
    """Cap on running requests per node."""


class Profile(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One node type: model + hardware + parallelism."""

    name: str
    description: str = ""
    block_size: PosInt = 64
    """Tokens per KV block (page)."""
    gpus_per_node: PosInt = 4
    kv_bytes_per_token: PosInt
    prefill: PrefillModel
    decode: DecodeModel
    memory: MemoryProfile
    links: LinkProfile
    scheduler: SchedulerProfile = SchedulerProfile()

    @property
    def gpu_blocks(self) -> int:
        """L1 capacity in blocks."""
        return self.memory.gpu_kv_tokens // self.block_size

    @property
    def host_blocks(self) -> int:
        """L2 capacity in blocks."""
        return self.memory.host_kv_tokens // self.block_size

    def kv_transfer_s(self, tokens: int) -> float:
        """GPU-to-GPU transfer time of ``tokens`` of KV (prefill → decode), s."""
        return self.links.gpu_to_gpu_latency_s + tokens * self.kv_bytes_per_token / self.links.gpu_to_gpu_bytes_per_s

    def restore_s(self, tokens: int) -> float:
        """Host → GPU restore time of ``tokens`` of KV on one node, s."""
        return tokens * self.kv_bytes_per_token / self.links.host_to_gpu_bytes_per_s


class ProfileError(ValueError):
    """A profile file is missing or invalid."""


def available_profiles() -> list[str]:
    """Names of the profiles shipped in ``shared/profiles``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str) -> Profile:
    """Load a shipped profile by name or any profile file by path.

    Raises:
        ProfileError: if the file does not exist, is not TOML, or fails validation.
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ProfileError(f"profile {name_or_path!r} not found (shipped: {', '.join(available_profiles())})")
    try:
        data = tomllib.loads(path.read_text())
        return msgspec.convert(data, Profile)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as e:
        raise ProfileError(f"invalid profile {path}: {e}") from e


def cluster_seconds_per(clock: ProfileClock, speedup: float) -> float:
    """Cluster seconds per second of a time given on ``clock``: ``speedup`` for ``wall`` (wall seconds
    measured at speed-up 1: a real engine's, whose durations are wall x ``speedup`` on the cluster clock),
    1 for ``cluster`` (simulated seconds, as written). The factor :func:`on_cluster_clock` multiplies a
    profile's times by; also the router's ``--ttft-fetch-base-s``, ``--ttft-fetch-per-token-s`` and
    ``--ttft-copy-price-s-per-token``, given on ``--profile-clock``'s clock as the profile's times.

    Raises:
        ProfileError: ``speedup`` not positive finite, or an unknown ``clock``.
    """
    if not 0 < speedup < float("inf"):
        raise ProfileError(f"speedup must be a positive finite number (cluster s per wall s), got {speedup!r}")
    if clock not in ("cluster", "wall"):
        raise ProfileError(f"profile clock must be 'cluster' or 'wall', got {clock!r}")
    return speedup if clock == "wall" else 1.0


def on_cluster_clock(profile: Profile, clock: ProfileClock, speedup: float) -> Profile:
    """``profile`` on the cluster clock of speed-up ``speedup`` (cluster seconds per wall second).

    A ``wall`` profile holds a real engine's times measured in wall seconds at speed-up 1 (``torch-tiny-cpu``,
    or any ``--profile`` with ``--engine torch``); that engine's durations are wall x ``speedup`` on the
    cluster clock (``services.worker.engines.torch_engine.TorchEngine``), so every time is multiplied by
    ``speedup`` and every bandwidth divided by it: the Eq. 1/2 coefficients ``c0``..``c3``, ``d0``..``d2``
    (s, s/token, s/pair), the link latencies (s) and the link bandwidths (bytes/s). Sizes, counts and the
    MoE shape are not times and stay. A ``cluster`` profile (a sim engine's: already simulated seconds), or
    speed-up 1, is returned as it is (the same object).

    Args:
        profile: the loaded profile (:func:`load_profile`).
        clock: :data:`ProfileClock`, what the profile's times are.
        speedup: cluster seconds per wall second (``--speedup``), positive and finite.

    Raises:
        ProfileError: ``speedup`` not positive finite, or an unknown ``clock``.
    """
    n = cluster_seconds_per(clock, speedup)
    if n == 1:
        return profile
    pre, dec, links = profile.prefill, profile.decode, profile.links
    return msgspec.structs.replace(
        profile,
        prefill=msgspec.structs.replace(pre, c0=pre.c0 * n, c1=pre.c1 * n, c2=pre.c2 * n, c3=pre.c3 * n),
        decode=msgspec.structs.replace(dec, d0=dec.d0 * n, d1=dec.d1 * n, d2=dec.d2 * n),
        links=msgspec.structs.replace(
            links,
            gpu_to_gpu_bytes_per_s=links.gpu_to_gpu_bytes_per_s / n,
            gpu_to_gpu_latency_s=links.gpu_to_gpu_latency_s * n,
            peer_fetch_bytes_per_s=links.peer_fetch_bytes_per_s / n,
            peer_fetch_latency_s=links.peer_fetch_latency_s * n,
            host_to_gpu_bytes_per_s=links.host_to_gpu_bytes_per_s / n,
        ),
    )


def with_kv_tokens(profile: Profile, gpu_kv_tokens: int = 0, host_kv_tokens: int = 0) -> Profile:
    """``profile`` with its node's KV memory resized (``up`` / worker ``--gpu-kv-tokens`` / ``--host-kv-tokens``),
    so that a user sizes the KV for a model without writing a profile file; 0 keeps the profile's value.

    A GPU size alone that is more than the profile's host size raises the host size to it too: L2 is
    written through and must hold L1 (``services.worker.blocks.KvBlockManager``).

    Args:
        profile: the loaded profile.
        gpu_kv_tokens: L1 tokens (``memory.gpu_kv_tokens``), a multiple of ``block_size``; 0 = the profile's.
        host_kv_tokens: L2 tokens (``memory.host_kv_tokens``), a multiple of ``block_size``, at least the L1
            size; 0 = the profile's (or the L1 size when that is more).

    Raises:
        ProfileError: a negative size, one that is not a positive multiple of the block size, or a host size
            below the GPU size (each message names the flag).
    """
    bs = profile.block_size
    for flag, value in (("--gpu-kv-tokens", gpu_kv_tokens), ("--host-kv-tokens", host_kv_tokens)):
        if value < 0 or value % bs:
            raise ProfileError(
                f"{flag} {value}: must be a positive multiple of the block size {bs} of profile {profile.name} "
                f"(e.g. {max(bs, -(-max(value, 1) // bs) * bs)}); 0 = the profile's"
            )
    if not gpu_kv_tokens and not host_kv_tokens:
        return profile
    gpu = gpu_kv_tokens or profile.memory.gpu_kv_tokens
    host = host_kv_tokens or max(profile.memory.host_kv_tokens, gpu)
    if host < gpu:
        # (a host size alone can only be below the profile's GPU size: name that as the profile's, not as a flag)
        gpu_from = "--gpu-kv-tokens" if gpu_kv_tokens else f"profile {profile.name}'s memory.gpu_kv_tokens"
        raise ProfileError(
            f"--host-kv-tokens {host} is less than {gpu_from} {gpu}: host memory (L2) is written through and must "
            f"hold the GPU KV (L1); pass --host-kv-tokens {gpu} or more"
            + ("" if gpu_kv_tokens else ", or a smaller --gpu-kv-tokens with it")
        )
    return msgspec.structs.replace(profile, memory=MemoryProfile(gpu_kv_tokens=gpu, host_kv_tokens=host))
