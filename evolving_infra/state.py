"""How command-line tools find the running local cluster: the state file ``up`` writes.

``evolving-infra up`` (and ``demo``, while it replays) writes ``<state dir>/up-<pid>.json`` once every service is healthy —
the router URL, the NATS URL, the partition, the log folder and every process id — rewrites it
(atomically) with the new process ids and restart counts when its supervisor restarts a service, and
removes it when it stops (Ctrl-C, SIGTERM, SIGHUP). ``split`` and ``tap`` read it when neither ``--nats-url``
nor ``EI_NATS_URL`` is given, ``status`` unless ``--router-url`` / ``--nats-url`` name another cluster. A file whose launcher process is gone (killed, machine rebooted) is stale: it is
removed when found, and says so. The state dir is ``$EI_STATE_DIR`` if set, else
``$XDG_RUNTIME_DIR/evolving-infra``, else ``~/.local/state/evolving-infra``.
"""

from __future__ import annotations

import argparse

import json
import os
import sys
from pathlib import Path
from typing import Any

from shared.auth import redact_url, write_private


class ClusterNotFound(RuntimeError):
    """No running local cluster (or several, and nothing says which); the message says what to do."""


def state_dir() -> Path:
    """Folder of the state files (see the module docstring); not created here."""
    if os.environ.get("EI_STATE_DIR"):
        return Path(os.environ["EI_STATE_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "evolving-infra"
    return Path.home() / ".local" / "state" / "evolving-infra"


def write_state(info: dict[str, Any], pid: int | None = None) -> Path:
    """Write this launcher's state file atomically, mode 0600 (its folder, when created, 0700); returns its path.

    Args:
        info: what runs (``router_url``, ``nats_url``, ``partition``, ``log_dir``, ``pids``, ...).
        pid: the launcher's process id (default: this process).

    Raises:
        OSError: if the state dir cannot be created or written.
    """
    pid = os.getpid() if pid is None else pid
    folder = state_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / f"up-{pid}.json"
    tmp = path.with_name(path.name + ".tmp")
    # mode 0600: it names the cluster's credential files and its NATS URL, which may carry a password
    write_private(tmp, (json.dumps({**info, "pid": pid}, indent=2, sort_keys=True) + "\n").encode())
    os.replace(tmp, path)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _mtime(path: Path) -> float:
    """``path``'s modification time; 0 for a file gone since the folder was listed (its launcher stopped: the
    read that follows skips it)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def running_clusters(*, remove_stale: bool = True) -> list[dict[str, Any]]:
    """State of every cluster whose launcher is alive, oldest file first.

    Unreadable files and files of dead launchers are removed (``remove_stale``), with a note
    on stderr, so a crash leaves no lasting trace.
    """
    folder = state_dir()
    if not folder.is_dir():
        return []
    out: list[dict[str, Any]] = []
    for path in sorted(folder.glob("up-*.json"), key=_mtime):
        try:
            info = json.loads(path.read_text())
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            info, pid = None, -1
        if info is not None and pid > 0 and _alive(pid):
            info["state_file"] = str(path)
            out.append(info)
        elif remove_stale:
            try:
                path.unlink()
                print(f"note: removed a stale cluster state file {path} (its launcher, pid {pid}, is gone)", file=sys.stderr)
            except OSError:
                pass
    return out


def fill_nats_url(args: argparse.Namespace) -> str | None:
    """Give ``args.nats_url``, when it was not passed (``--nats-url``), ``EI_NATS_URL`` (as the services and
    ``auth stream`` read it) or else the running local cluster's NATS URL, for the CLI tools that talk to a
    live cluster (``split``, ``tap``). ``EI_NATS_URL`` keeps a password in the URL out of the process list,
    where ``--nats-url`` shows it to every local user.

    ``up`` itself does not read ``EI_NATS_URL`` (it starts its own server unless ``--nats-url``), so a URL left
    exported in the shell (another cluster's) would silently take ``split`` / ``tap`` away from the local
    cluster ``up`` just started (``split set`` changed that other cluster's split): when a live local cluster of
    the partition runs on another server, a note on stderr names both.

    Returns:
        None when ``args.nats_url`` is set, or the reason no cluster was found (the caller
        prints it and exits non-zero).
    """
    if args.nats_url is None and os.environ.get("EI_NATS_URL"):
        args.nats_url = os.environ["EI_NATS_URL"]
        local = [c for c in running_clusters(remove_stale=False) if c.get("partition", "p0") == args.partition]
        if local and all(c.get("nats_url") != args.nats_url for c in local):
            listed = "; ".join(f"{redact_url(str(c.get('nats_url')))} (router {c.get('router_url')}, pid {c.get('pid')})" for c in local)
            print(f"note: using EI_NATS_URL ({redact_url(args.nats_url)}), not the local cluster `up` started: {listed}; "
                  "unset EI_NATS_URL or pass --nats-url to pick one", file=sys.stderr)
    if args.nats_url is None:
        try:
            args.nats_url = find_nats_url(args.partition)
        except ClusterNotFound as e:
            return str(e)
    return None


def not_found_message(otherwise: str = "pass --nats-url (or set EI_NATS_URL)") -> str:
    """What to say when no running local cluster is found: where no state file was, and how to start one or
    (``otherwise``: the calling command's options) reach a cluster started otherwise."""
    return (f"no running local cluster found (no live state file in {state_dir()}); start one with "
            f"`evolving-infra up`, or {otherwise} for a cluster started otherwise")


def find_nats_url(partition: str | None = None) -> str:
    """The NATS URL of the one running local cluster (of ``partition``, if given).

    Raises:
        ClusterNotFound: none runs, or several and they are not told apart by ``partition``.
    """
    found = running_clusters()
    if partition is not None:
        found = [c for c in found if c.get("partition", "p0") == partition] or found
    if not found:
        raise ClusterNotFound(not_found_message())
    if len(found) > 1:
        listed = "; ".join(f"{redact_url(str(c.get('nats_url')))} (router {c.get('router_url')}, pid {c.get('pid')})" for c in found)
        raise ClusterNotFound(f"{len(found)} local clusters are running: {listed}; pass --nats-url to pick one")
    return str(found[0]["nats_url"])
