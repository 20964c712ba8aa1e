"""A command's output folder (``--out OUT``): held by one run at a time (:func:`hold_out`), an earlier run's outputs
set aside to ``OUT/previous/`` once the run has ended, just before its own are written (:func:`set_aside_previous_run`),
so that a run that fails or is killed leaves them in place; ``replay`` and ``demo``, which append each record as it
completes, append to a file of the run's own meanwhile (:func:`partial_records`).

Used by ``replay``, ``demo``, ``simulate``, ``fidelity`` and ``report``; kept apart from ``evolving_infra.replay.cli``
so that ``simulate`` imports none of the live stack (asyncio, httpx) to hold its ``OUT``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import TextIO

PREVIOUS = "previous"
LOCK = ".evolving-infra.lock"
"""The file in ``OUT`` whose exclusive ``flock`` a run holds from before its set-aside to its report
(:func:`hold_out`); removed when the run ends."""


class OutFolderError(Exception):
    """``OUT`` cannot take this run without touching files that are not a run's, or without a run's outputs being
    lost: ``OUT`` or ``OUT/previous`` is not a folder, ``OUT/previous`` holds something other than a run's outputs
    (:func:`check_previous_run`), the move to it failed (:func:`set_aside_previous_run`), or another run is
    writing to ``OUT`` (:func:`hold_out`). The message is one line naming the path: :attr:`reason` (what is wrong)
    then what the user can do about it, if anything.

    Args:
        reason: what is wrong, naming the path.
        advice: what the user can do, with its separator (``": wait for it to end, or choose another --out"``);
            empty: none. :func:`set_aside_or_elsewhere`, which does something else instead, shows the reason alone.
    """

    def __init__(self, reason: str, advice: str = "") -> None:
        super().__init__(reason + advice)
        self.reason = reason


class NoFlockError(OutFolderError):
    """The file system of ``OUT`` gives no ``flock`` (Lustre mounted ``noflock``: ENOSYS; NFS without its lock
    manager: ENOLCK), so :func:`hold_out` cannot hold it: one line naming the lock file, the error and its likely
    cause, worded for any folder (an ``--out``, ``report show``'s ``RUN_DIR``); ``report show`` catches it to show the
    summary without writing, as for a read-only folder."""


def partial_records(out: Path, run_id: str) -> Path:
    """``out/requests.partial-<run_id>.jsonl``: the file ``replay`` and ``demo`` append each answered request's record
    to as it completes (``RecordAppender``), a name of this run's alone, not a run's output name: the outputs in
    ``out`` stay an earlier run's until this run has ended and sets them aside (:func:`set_aside_previous_run`),
    and the records of a run that fails or is killed stay in this file, never mixed with another run's. Once the
    run's ``requests.jsonl`` is written it is removed (:func:`drop_partial_records`)."""
    return out / f"requests.partial-{run_id}.jsonl"


def note_leftover_partial_records(out: Path, command: str) -> list[Path]:
    """One ``note:`` line on stderr naming the :func:`partial_records` files already in ``out`` when a run takes it
    (call it holding :func:`hold_out`: no other run is writing one then, so each is the records of a ``replay`` or
    ``demo`` killed before its report), which nothing else reads or removes. Returns them (sorted; empty: no line).
    Raises nothing (an unreadable ``out``: none found)."""
    try:
        found = sorted(p for p in out.glob("requests.partial-*.jsonl") if p.is_file())
    except OSError:
        return []
    if found:
        shown_names = ", ".join(p.name for p in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        print(f"note: {command}: --out {out} holds the records of {len(found)} earlier run(s) killed before their "
              f"report ({shown_names}: one JSON record a line, as requests.jsonl); left in place", file=sys.stderr)
    return found


def drop_partial_records(path: Path, *, only_empty: bool = False) -> bool:
    """Remove a run's :func:`partial_records` file: once its ``requests.jsonl`` is written, or (``only_empty``) when
    the run failed before any record was appended, so that ``OUT`` is as it was. Returns whether it is gone (False:
    it holds records and ``only_empty``, or it could not be removed). Raises nothing."""
    try:
        if only_empty and path.stat().st_size:
            return False
        path.unlink()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _run_outputs() -> tuple[str, ...]:
    """The names a run writes in ``OUT``: its report, records, planner decisions (``simulate``), page and every plot
    it may draw."""
    from evolving_infra.report.write import DECISIONS_JSONL, REPORT_HTML, REPORT_JSON, REQUESTS_JSONL, RUN_PLOTS

    return (REPORT_JSON, REQUESTS_JSONL, DECISIONS_JSONL, REPORT_HTML, *RUN_PLOTS)


@contextmanager
def hold_out(out: Path) -> Iterator[None]:
    """Hold ``out`` for one run: an exclusive, non-blocking ``flock`` on ``out/``:data:`LOCK` (holding this
    process's id), from before the set-aside of an earlier run's outputs to the end of the run's report, so that two
    runs into one ``--out`` never move or overwrite each other's files. Creates ``out``; the lock file is removed on
    exit (the kernel drops the lock of a killed run: its file is taken over by the next). Once held, what a run
    killed during its set-aside left in ``out`` is put back (:func:`recover_set_aside`).

    The lock is only as wide as the file system's ``flock``: one for every host on local disks, NFSv4 and Lustre
    mounted ``flock``; per host on BeeGFS (client-local flocks by default), Lustre ``localflock`` and NFS
    ``local_lock=flock``, where runs on two hosts can both hold ``out``; none on Lustre ``noflock``, refused.

    Raises:
        OutFolderError: ``out`` is not a folder, or another process holds the lock (its id named when known).
        NoFlockError: the file system gives no ``flock`` (the lock file this call made removed again).
        OSError: ``out`` or the lock file cannot be made.
    """
    if out.exists() and not out.is_dir():
        raise OutFolderError(f"{out} is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    fd = _lock_file(path)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        recover_set_aside(out)
        yield
    finally:
        _unlock_file(path, fd)


def _lock_file(path: Path) -> int:
    """An exclusive, non-blocking ``flock`` on ``path`` (made when missing; removed again when it cannot be locked):
    :func:`hold_out`'s lock. Returns the descriptor holding it (release it with :func:`_unlock_file`).

    Raises:
        OutFolderError: another process holds it (its id named when it wrote one).
        NoFlockError: the file system gives no ``flock``.
        OSError: ``path`` cannot be made or opened.
    """
    while True:
        try:  # made here (then removed again if it cannot be locked), or another run's
            fd, made = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), True
        except FileExistsError:
            try:
                fd, made = os.open(path, os.O_RDWR | os.O_CLOEXEC), False
            except FileNotFoundError:  # its run ended meanwhile
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            who = f"another run (pid {holder})" if holder.isdigit() else "another run"
            raise OutFolderError(f"{who} is writing to it (it holds {path})",
                                 ": wait for it to end, or choose another --out") from None
        except OSError as e:  # no flock on this file system (Lustre mounted noflock: ENOSYS), or no lock manager
            os.close(fd)
            if made:
                with suppress(OSError):
                    os.unlink(path)
            why = {errno.ENOLCK: "NFS without its lock manager?", errno.ENOSYS: "Lustre mounted noflock?"}
            raise NoFlockError(f"cannot lock {path} ({e.strerror or e}): this file system gives no flock"
                               + (f" ({why[e.errno]})" if e.errno in why else "")
                               + ", and without it two runs into one folder would overwrite each other's outputs: "
                               "use a folder on another file system") from None
        except BaseException:
            os.close(fd)
            raise
        try:  # a run that ended between the open and the lock removed that file: lock the one at the path now
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        mine = os.fstat(fd)
        if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)
    return fd


def _unlock_file(path: Path, fd: int) -> None:
    """Release :func:`_lock_file`'s lock: ``path`` removed while still held (a run waiting on it then retries on a
    new file), only if it is still the file locked (it was not moved nor replaced meanwhile). Raises nothing."""
    try:
        st = os.stat(path)
        mine = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            os.unlink(path)
    except OSError:
        pass  # gone already (moved with its folder), or its folder no longer writable: released all the same
    os.close(fd)


def lock_folder(folder: Path) -> int:
    """Hold ``folder`` for as long as the returned descriptor stays open: :func:`hold_out`'s exclusive, non-blocking
    ``flock`` on ``folder/``:data:`LOCK` (holding this process's id), without its set-aside. ``up`` holds its
    ``--log-dir`` so for the cluster's life (``LocalCluster``), so that a second cluster on it is refused instead of
    overwriting the first's credentials and state files. A lock left by a process that is gone blocks nothing (the
    kernel dropped it with the process). Release it with :func:`unlock_folder`; ``folder`` must exist.

    Returns:
        The descriptor holding the lock (close-on-exec: children never inherit it).

    Raises:
        OutFolderError: another process holds it; :attr:`OutFolderError.reason` reads ``"another run (pid N) is
            writing to it (it holds FOLDER/.evolving-infra.lock)"`` (the pid named when known).
        NoFlockError: the file system gives no ``flock``.
        OSError: the lock file cannot be made or opened.
    """
    path = folder / LOCK
    fd = _lock_file(path)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except BaseException:
        _unlock_file(path, fd)
        raise
    return fd


def unlock_folder(folder: Path, fd: int) -> None:
    """Release :func:`lock_folder`'s lock on ``folder`` (its lock file removed if it is still the one locked).
    Raises nothing."""
    _unlock_file(folder / LOCK, fd)


def folder_holder(folder: Path) -> str | None:
    """Who holds ``folder`` now (:func:`lock_folder`, :func:`hold_out`): ``'another run (pid N)'``, or None when
    nobody does. Touches nothing. Raises nothing."""
    return _lock_holder(folder)


def hold_new_out(held: ExitStack, out: Path) -> None:
    """Make ``out`` (and its missing parents) and hold it (:func:`hold_out`) until ``held`` closes; the folders made
    here are removed again after the lock's release when the run left them empty (``traces.io.remove_folders``).

    Raises:
        OutFolderError, OSError: as :func:`hold_out`; OSError also when ``out`` cannot be made.
    """
    from evolving_infra.traces.io import make_folders, remove_folders

    held.callback(remove_folders, make_folders(out))  # registered first: runs after the lock's release
    held.enter_context(hold_out(out))


def check_previous_run(out: Path) -> list[str]:
    """The outputs in ``out`` that :func:`set_aside_previous_run` would move to ``out/previous/``, touching nothing:
    every name a run writes (``report.json``, ``requests.jsonl``, ``decisions.jsonl``, ``report.html``, the
    :data:`~evolving_infra.report.write.RUN_PLOTS`) already there, an earlier run's or not, so none is overwritten;
    the user's other files (their own PNGs too) stay in place.

    Returns:
        The names to move, in that order (empty when ``out`` is absent or holds none of them).

    Raises:
        OutFolderError: ``out`` is not a folder, or ``out/previous`` (which the move replaces) is a symlink, is not
            a folder or holds anything but plain files of those names and :data:`LOCK` (the user's files, or a
            folder of theirs so named), or a ``report show`` of ``out/previous`` holds its lock now.
        OSError: ``out`` or ``out/previous`` cannot be read.
    """
    if not out.exists():
        return []
    if not out.is_dir():
        raise OutFolderError(f"{out} is not a folder")
    own = _run_outputs()
    names = [n for n in own if os.path.lexists(out / n)]
    if not names:
        return []
    prev = out / PREVIOUS
    if prev.is_symlink():
        what = "to a folder" if prev.is_dir() else "not to a folder" if prev.exists() else "to nothing"
        raise OutFolderError(f"{prev} is a symlink ({what}), and the outputs in {out} this run would overwrite are "
                             "moved there", ": move or remove it, or choose another --out")
    if prev.exists() and not prev.is_dir():
        raise OutFolderError(f"{prev} is not a folder, and the outputs in {out} this run would overwrite are moved "
                             "there", ": move or remove it, or choose another --out")
    if prev.is_dir():
        holder = _lock_holder(prev)
        if holder is not None:
            raise OutFolderError(f"{holder} is writing to {prev} (it holds {prev / LOCK}: 'report show' redrawing it), "
                                 f"and the outputs in {out} this run would overwrite would replace it there",
                                 ": wait for it to end, or choose another --out")
        foreign = sorted(p.name for p in prev.iterdir() if not _run_file(p, own))
        if foreign:
            shown_names = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise OutFolderError(f"{prev} holds files that are not a run's outputs ({shown_names}); the outputs in "
                                 f"{out} this run would overwrite would replace it there: nothing was changed",
                                 f"; move or rename {prev}, or choose another --out")
    return names


def _run_file(p: Path, own: tuple[str, ...] | set[str]) -> bool:
    """Whether ``p``, in a ``previous/``, is a plain file of a run's: one of the names ``own`` or the :data:`LOCK`
    a ``report show`` of that folder left (killed: the kernel dropped its lock, the file stays)."""
    return (p.name in own or p.name == LOCK) and not p.is_symlink() and p.is_file()


def _lock_holder(folder: Path) -> str | None:
    """Who holds ``folder/``:data:`LOCK` now (``'another run (pid N)'``), or None: no such file, or nobody holds
    it (taken and released at once: a shared ``flock``, read-only). Raises nothing."""
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return f"another run (pid {pid})" if pid.isdigit() else "another run"
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def set_aside_previous_run(out: Path) -> list[str]:
    """Move the outputs in ``out`` this run would overwrite (the names :func:`check_previous_run` gives: an earlier
    run's, or the user's files of those names) to ``out/previous/``, so they are never overwritten nor read as
    this run's. ``previous/`` keeps one generation: an older one (a run's outputs alone: checked) is replaced.
    The move is all or nothing: the names go to a new folder inside ``out`` first, which then takes
    ``previous``'s place; the older one is deleted last. ``previous/``'s own lock (a ``report show`` of it holds it)
    is held, non-blocking, from after the check to the end of the move. Creates ``out``. Call it holding
    :func:`hold_out`.

    Returns:
        The names moved (empty when ``out`` held none).

    Raises:
        OutFolderError: as :func:`check_previous_run`, or ``previous/``'s lock taken by a ``report show`` since,
            before anything is moved or removed; or a move failed
            (``out`` read-only or immutable, a full disk): everything was put back, the older ``previous/``
            as it was.
        OSError: ``out`` cannot be made or read.
    """
    out.mkdir(parents=True, exist_ok=True)
    names = check_previous_run(out)
    if not names:
        return []
    prev = out / PREVIOUS
    held = _hold_previous(out, prev)
    try:
        return _set_aside(out, prev, names)
    finally:
        if held is not None:
            _unlock_file(prev / LOCK, held)


def _hold_previous(out: Path, prev: Path) -> int | None:
    """``prev``'s lock (:func:`_lock_file`, non-blocking), held for the set-aside that replaces ``prev``, so that a
    ``report show`` of it cannot start redrawing it between :func:`check_previous_run`'s look and the move. Returns
    the descriptor; None when there is no ``prev`` folder, or its file system gives no ``flock`` (no ``report show``
    can hold it either). The lock file made here goes with the older ``previous/`` when it is replaced.

    Raises:
        OutFolderError: a ``report show`` of ``prev`` holds it now; or it cannot be made.
    """
    if not prev.is_dir() or prev.is_symlink():
        return None
    try:
        fd = _lock_file(prev / LOCK)
    except NoFlockError:
        return None
    except OutFolderError as e:
        raise OutFolderError(f"{prev}: {e.reason} ('report show' redrawing it), and the outputs in {out} this run "
                             "would overwrite would replace it there", ": wait for it to end, or choose another --out") from None
    except OSError as e:
        raise OutFolderError(f"cannot lock {prev / LOCK} ({e.strerror or e}) for the move of the outputs in {out} "
                             "this run would overwrite", "; choose another --out, or make it writable") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:
        pass  # the lock holds all the same; a refused run names no pid
    return fd


def _set_aside(out: Path, prev: Path, names: list[str]) -> list[str]:
    """:func:`set_aside_previous_run`'s move of ``names`` (checked) to ``prev``, ``prev``'s lock held."""
    moved: list[str] = []
    staged: Path | None = None
    older: Path | None = None
    try:
        staged = _new_folder(out, "tmp")
        for n in names:
            os.rename(out / n, staged / n)
            moved.append(n)
        if prev.is_dir():
            older = _new_folder(out, "old")
            os.rename(prev, older / PREVIOUS)
        os.rename(staged, prev)
    except OSError as e:
        undone = _undo_set_aside(out, prev, staged, moved, older)
        raise OutFolderError(f"cannot move the outputs in {out} this run would overwrite to {prev}/ "
                             f"({e.strerror or e}: {e.filename or out}): "
                             + ("nothing was moved: " if undone else "")
                             + (f"{prev} is as it was" if undone else f"some could not be put back: see {out}/.{PREVIOUS}.*"),
                             "; choose another --out, or make it writable") from None
    if older is not None:  # the older run's outputs alone (checked): deleted last, once the new previous/ is in place
        try:
            for p in (older / PREVIOUS).iterdir():
                p.unlink()
            (older / PREVIOUS).rmdir()
            older.rmdir()
        except OSError as e:
            print(f"warning: --out {out}: the older {PREVIOUS}/ replaced could not be deleted ({e}); it is in {older}",
                  file=sys.stderr)
    return names


def set_aside_note(command: str, out: Path, moved: list[str]) -> str:
    """The line ``command`` (``replay``, ``demo``, ``simulate``) shows for what :func:`set_aside_previous_run` moved
    (``moved``, not empty), once its run has ended."""
    return (f"{command}: the outputs in {out} this run would overwrite moved to {out / PREVIOUS}/ ({', '.join(moved)}; "
            "it keeps only the last run's)")


OUTPUTS_ELSEWHERE = 4
"""Exit status of a ``simulate`` (a ``--sweep`` too), ``replay``, ``demo`` or ``fidelity`` that ran to its end but
wrote its outputs (or a sweep item's, a fidelity side's) to a ``run-<id>/`` folder of their own
(:func:`set_aside_or_elsewhere`, one ``warning:`` line naming it), because the earlier run's could not be set aside
to ``previous/`` then: ``OUT/report.json`` is still the earlier run's. It replaces 0 and 1 (failed requests: the
report says how many); a run stopped by a signal still exits 128 + the signal (130, 143)."""

SET_ASIDE_WAIT_S = 5.0
"""How long :func:`set_aside_or_elsewhere` waits for a ``report show`` of ``OUT/previous`` (which holds its lock
while it redraws: seconds) before this run's outputs go to a folder of their own instead."""


def set_aside_or_elsewhere(out: Path, command: str, run_id: str | None = None, *, wait_s: float | None = None,
                           file: TextIO | None = None) -> Path:
    """Where a run that has ended writes its outputs: ``out``, its earlier run's set aside first
    (:func:`set_aside_previous_run`, the :func:`set_aside_note` on ``file``), or, when that set-aside is refused now
    (a ``report show`` of ``out/previous`` still holding its lock after ``wait_s`` seconds, the user's files put in
    ``out/previous`` during the run, a failed move), a new folder ``out/run-<run_id>/`` (one ``warning:`` line on
    stderr naming it and why), so that a finished run's outputs are never dropped. Call it holding ``out``
    (:func:`hold_out`), once the run has ended. A run per sub-folder of ``OUT`` (each side of ``fidelity``, each item
    of a ``--sweep``) calls it on that folder, holding ``OUT``, after :func:`recover_set_aside` then
    :func:`check_previous_run` on it before the run (``hold_out`` recovers ``OUT`` itself only), so that what a
    killed run left there is put back and the refusals come first.

    Args:
        out: the run's ``--out``.
        command: the command's name in the lines printed (``replay``, ``demo``, ``simulate``, ``fidelity``,
            ``simulate --sweep``).
        run_id: names the fallback folder (the report's ``meta.run_id``); a new 12-hex id when None.
        wait_s: seconds to wait, retrying every 0.2 s, while another process holds ``out/previous``'s lock
            (None: :data:`SET_ASIDE_WAIT_S`, read at the call).
        file: the stream of the set-aside's note (stderr when None; ``demo`` prints it on stdout).

    Returns:
        The folder to write the run's outputs to: ``out`` or ``out/run-<run_id>`` (the command then exits
        :data:`OUTPUTS_ELSEWHERE`).

    Raises:
        OutFolderError: the set-aside was refused and ``out/run-<run_id>`` cannot be made either (its message
            names both).
    """
    deadline = time.monotonic() + (SET_ASIDE_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            moved = set_aside_previous_run(out)
        except (OutFolderError, OSError) as e:
            if time.monotonic() < deadline and _lock_holder(out / PREVIOUS) is not None:
                time.sleep(0.2)
                continue
            refused = e.reason if isinstance(e, OutFolderError) else str(e)  # the advice is not for this: done below
            break
        if moved:
            print(set_aside_note(command, out, moved), file=file or sys.stderr, flush=True)
        return out
    if run_id is None:
        import uuid  # here: evolving_infra.cli imports this module for OUTPUTS_ELSEWHERE, and needs no uuid

        run_id = uuid.uuid4().hex[:12]
    fresh = out / f"run-{run_id}"
    try:
        fresh.mkdir()
    except OSError as e:
        raise OutFolderError(f"{refused}; and {fresh} cannot be made for this run's outputs instead "
                             f"({e.strerror or e})") from None
    print(f"warning: --out {out}: {refused}; this run's outputs are written to {fresh}/ instead", file=sys.stderr,
          flush=True)
    return fresh


def _new_folder(out: Path, tag: str) -> Path:
    """A new empty folder ``out/.previous.<tag>-<pid>-<n>`` (the first ``n`` free), made with the process's umask
    as ``previous/`` itself would be. Raises OSError when it cannot be made."""
    for n in range(1000):
        path = out / f".{PREVIOUS}.{tag}-{os.getpid()}-{n}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{out}/.{PREVIOUS}.{tag}-{os.getpid()}-*: 1000 exist already")


def _undo_set_aside(out: Path, prev: Path, staged: Path | None, moved: list[str], older: Path | None) -> bool:
    """Put back what :func:`set_aside_previous_run` had moved when a later step failed. Returns whether all of it
    was (every name at its place in ``out``, ``prev`` as it was, no folder of the move left)."""
    ok = True
    try:
        if older is not None and (older / PREVIOUS).exists() and not os.path.lexists(prev):
            os.rename(older / PREVIOUS, prev)
        if older is not None:
            older.rmdir()
    except OSError:
        ok = False
    if staged is not None and os.path.isdir(staged):
        for n in reversed(moved):
            try:
                os.rename(staged / n, out / n)
            except OSError:
                ok = False
        try:
            staged.rmdir()
        except OSError:
            ok = False
    return ok


_LEFTOVER = re.compile(r"\.previous\.(tmp|old)-([1-9][0-9]{0,6})-([0-9]{1,4})")
"""The folders :func:`set_aside_previous_run` makes in ``OUT`` (:func:`_new_folder`): kind, process id, number."""


def recover_set_aside(out: Path) -> list[str]:
    """Undo what a :func:`set_aside_previous_run` that never ended (SIGKILL, OOM, power loss) left in ``out``: its
    ``.previous.tmp-<pid>-<n>`` (the outputs it had moved out of ``out``: their only copy) and
    ``.previous.old-<pid>-<n>`` (the older ``previous/`` it was replacing). Call it holding :func:`hold_out` (which
    does): a set-aside runs only under that lock, so every such folder seen with it held was left by a run that
    ended, whatever its ``pid`` is now here (a container's runs are all pid 1; the pid reused; a run on another
    host sharing ``out``), and each is recovered.

    ``out`` is put back as it was before that set-aside, so that this run's own set-aside moves those outputs to
    ``previous/`` as the killed one meant to: an ``old`` folder's ``previous/`` goes back to ``out/previous`` when
    that is missing (the killed run had moved it away), else it is the generation the killed run had replaced and
    is deleted (when it holds a run's plain output files alone); a ``tmp`` folder's files go back to ``out`` under
    their names; where ``out`` has a file of that name already (a run of a version without this step ran since) the
    folder becomes ``out/previous`` when there is none, else it is left in place with a warning. Each step says
    what it did in one line on stderr (``note:``, or ``warning:`` for what is left in place: never silently).

    Returns:
        The lines printed (empty when nothing was left, or ``out`` does not exist).
    """
    said: list[str] = []

    def say(line: str, *, kept: bool = False) -> None:  # kept: left in place, for the user to sort out
        said.append(line)
        print(f"{'warning' if kept else 'note'}: --out {out}: {line}", file=sys.stderr)

    try:
        matched = [(m, p) for p in out.iterdir() if (m := _LEFTOVER.fullmatch(p.name))]
    except FileNotFoundError:  # no such folder (a sweep item or fidelity side not yet run): nothing left there
        return said
    except OSError as e:
        say(f"cannot look for what a run killed while setting its outputs aside left ({e.strerror or e}); "
            "nothing recovered", kept=True)
        return said
    found = []
    for m, p in matched:
        if p.is_dir() and not p.is_symlink():
            found.append((m.group(1), int(m.group(2)), int(m.group(3)), p))
        else:
            say(f"{p} is named as a set-aside's folder but is {'a symlink' if p.is_symlink() else 'not a folder'}: "
                "left in place; move or remove it", kept=True)
    prev = out / PREVIOUS
    own = set(_run_outputs())
    # old before tmp: the older previous/ first goes back to its place, then the staged outputs to theirs
    for kind, pid, _n, path in sorted(found, key=lambda f: (f[0] != "old", f[1], f[2])):
        who = f"a run (pid {pid}) that ended while setting its outputs aside"
        try:
            if kind == "old":
                held = path / PREVIOUS
                if held.is_dir() and not held.is_symlink() and not os.path.lexists(prev):
                    os.rename(held, prev)
                    say(f"{who} had moved {PREVIOUS}/ to {path.name}: put back")
                elif os.path.lexists(held):
                    other = [q.name for q in held.iterdir() if not _run_file(q, own)] \
                        if held.is_dir() and not held.is_symlink() else [held.name]
                    if other:
                        say(f"{path} ({who}) holds files that are not a run's outputs ({', '.join(sorted(other)[:3])}); "
                            "left in place", kept=True)
                        continue
                    for q in held.iterdir():
                        q.unlink()
                    held.rmdir()
                    say(f"{who} had replaced {PREVIOUS}/ and not yet deleted the older one ({path.name}): deleted")
                path.rmdir()
                continue
            names = sorted(q.name for q in path.iterdir())
            if not names:
                path.rmdir()
                continue
            clash = [n for n in names if os.path.lexists(out / n)]
            if not clash:
                for n in names:
                    os.rename(path / n, out / n)
                path.rmdir()
                say(f"{who} had moved {', '.join(names)} to {path.name}: put back (this run's set-aside moves them)")
            elif not os.path.lexists(prev):
                os.rename(path, prev)
                say(f"{who} had moved {', '.join(names)} to {path.name}; {', '.join(clash)} are in {out} again: "
                    f"{path.name} is now {PREVIOUS}/")
            else:
                say(f"{path} ({who}) holds {', '.join(names)}, and {out} has {', '.join(clash)} again and a "
                    f"{PREVIOUS}/: left in place; move what you keep of it, then remove it", kept=True)
        except OSError as e:
            say(f"{path} ({who}) could not be put back ({e.strerror or e}: {e.filename or path}): left in place", kept=True)
    return said
