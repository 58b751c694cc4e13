"""Run untrusted Python (model-written programs) in a sandboxed subprocess
(docs/methods.md, "Code sandbox": its layers, what they hold and what they do not).

    >>> from stabledrl.sandbox import SandboxLimits, run_python
    >>> r = run_python("print(6 * 7)", SandboxLimits(timeout_s=2))
    >>> r.ok, r.reason, r.stdout
    (True, 'ok', '42\\n')

`run_python` never raises because of what the program does: every failure comes back as
`SandboxResult(ok=False, reason=...)`. It kills every process the program started and
removes its directory before returning. The program is its main process: the run ends
when that process exits, and whatever it leaves running is killed then.

Layers: a process group with a wall-time limit; network, PID, IPC and mount namespaces; a
read-only file system but for a private size-limited tmpfs; an unprivileged uid without
capabilities; resource limits; one memory bound for the whole program (a memory cgroup, or
a monitor); ``python -I`` with a bare environment; a Python audit hook. A layer the kernel
or our privileges do not allow is skipped and left out of `SandboxResult.layers`. Linux only.
"""

from __future__ import annotations

import io
import itertools
import logging
import math
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "UID_RANGE"]

logger = logging.getLogger(__name__)

UID_RANGE = range(2_000_000, 2_000_000 + 64 * 2**22)
"""Uids the sandbox runs programs as: each process owns the 64 at 2,000,000 + 64·(pid mod 2²²)
(pids are at most 2²² on Linux), so concurrent programs of different processes never share one."""
_UIDS_PER_PROCESS = 64
"""Unprivileged uids/gids the sandbox runs programs as when started by root."""

_ALL_LAYERS = ("process-group", "net-ns", "pid-ns", "ipc-ns", "mount-ns", "readonly-fs", "private-tmpfs",
               "uid", "no-caps", "no-new-privs", "rlimits", "memory-cgroup", "memory-monitor", "audit-hook")


@dataclass(frozen=True)
class SandboxResult:
    """What happened to one program."""

    ok: bool
    """The program exited with status 0 within every limit."""
    returncode: int | None
    """Exit status; -N when killed by signal N (as `subprocess`); None if it never ran."""
    reason: str
    """"ok", or why not: "timeout", "memory", "cpu time", "output cap", "process limit",
    "file size", "network refused", "write refused", "syntax error", "assertion failed",
    "nonzero exit", "killed by signal N", "sandbox error"."""
    stdout: str
    stderr: str
    seconds: float
    """Wall time of the whole sandboxed run, set-up and clean-up included."""
    layers: tuple[str, ...] = ()
    """The protection layers that were in force (see the module docstring)."""


# --- the bootstrap ------------------------------------------------------------------
_BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_boot.py")
"""The program that runs in the sandbox's fresh interpreter and sets up every layer: a
stdlib-only module of its own, run by path, because importing this module's dependencies
(subprocess, dataclasses, logging ...) there would cost ~25 ms per program."""


class _UidPool:
    """Hands out distinct uids of this process's slice of `UID_RANGE` to its concurrent runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[int] = set()
        self._pid = -1
        self._next = 0

    def take(self) -> int:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: its own slice
                self._pid, self._next, self._busy = os.getpid(), 0, set()
            first = UID_RANGE.start + _UIDS_PER_PROCESS * (self._pid % 2**22)
            for _ in range(_UIDS_PER_PROCESS):
                uid = first + self._next
                self._next = (self._next + 1) % _UIDS_PER_PROCESS
                if uid not in self._busy:
                    self._busy.add(uid)
                    return uid
        raise RuntimeError(f"more than {_UIDS_PER_PROCESS} concurrent sandboxes in one process")

    def give(self, uid: int) -> None:
        with self._lock:
            self._busy.discard(uid)


_UIDS = _UidPool()


# --- the memory cgroup of one program (module docstring, layer 6) --------------------
@dataclass(frozen=True)
class _Flavour:
    """Where a cgroup version keeps what we need."""

    join: str
    """The file the bootstrap writes "0" to, to move itself in. v1: "tasks", which moves one
    thread (its only one) and skips the lock that "cgroup.procs" takes for a whole thread
    group, whose release waits for an RCU grace period: 10-20 ms a program here. v2 has
    only "cgroup.procs" for a domain cgroup."""
    limits: tuple[str, ...]
    """Files that take the bound in bytes, in order; the first must exist, the others may not."""
    settings: tuple[tuple[str, str], ...]
    """(file, value) written where the file exists."""
    events: str
    """The file with an "oom_kill N" line."""


_V1 = _Flavour("tasks", ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"), (("memory.swappiness", "0"),),
               "memory.oom_control")
_V2 = _Flavour("cgroup.procs", ("memory.max",), (("memory.swap.max", "0"), ("memory.oom.group", "1")),
               "memory.events")

_USE_CGROUPS = True
"""False: bound memory with the monitor even where a cgroup would work (tests of the monitor)."""
_cgroup_parent: tuple[str, _Flavour] | None | bool = False  # False: not looked for yet
_cgroup_names = itertools.count()
_cgroup_lock = threading.Lock()


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _find_cgroup_parent() -> tuple[str, _Flavour] | None:
    """Our own memory cgroup, if we may create children there (v2 first, then v1's memory
    hierarchy); None where neither works. Never a cgroup above ours: a child of ours stays
    under every limit that we are under."""
    try:
        with open("/proc/self/cgroup") as f:
            ours = {}  # controller ("" for v2) -> our path in its hierarchy
            for line in f.read().splitlines():
                _, controllers, path = line.split(":", 2)
                for c in controllers.split(","):
                    ours[c] = path
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f.read().splitlines()]
    except (OSError, ValueError):
        return None
    found = []
    for fields in mounts:
        tail = fields[fields.index("-") + 1:]  # fstype, source, super options
        fstype, root, point = tail[0], fields[3], fields[4].replace("\\040", " ")
        if fstype == "cgroup2" and "" in ours:
            flavour, path = _V2, ours[""]
        elif fstype == "cgroup" and "memory" in tail[2].split(",") and "memory" in ours:
            flavour, path = _V1, ours["memory"]
        else:
            continue
        if path != root and not path.startswith(root.rstrip("/") + "/"):
            continue  # our cgroup is not below this mount's root
        here = os.path.normpath(os.path.join(point, os.path.relpath(path, root)))
        if flavour is _V2:
            try:
                with open(os.path.join(here, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        continue  # children of ours would have no memory controller
            except OSError:
                continue
        found.append((here, flavour))
    found.sort(key=lambda hf: hf[1] is _V1)  # v2 first
    for here, flavour in found:
        try:  # can we make one here?
            probe = os.path.join(here, f"stabledrl-{os.getpid()}-probe")
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError:
            continue
        _remove_stale(here)
        return here, flavour
    return None


def _remove_stale(parent: str) -> None:
    """Remove the empty cgroups of sandbox processes that died before they could."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith("stabledrl-")]
    except OSError:
        return
    for name in names:
        try:
            os.kill(int(name.split("-")[1]), 0)
            continue  # its process is alive (or the pid was reused): leave it
        except (ValueError, IndexError, PermissionError):
            continue
        except ProcessLookupError:
            pass
        try:
            os.rmdir(os.path.join(parent, name))
        except OSError:
            pass


class _MemoryCgroup:
    """One program's memory cgroup: made with the bound, read for OOM kills, removed."""

    def __init__(self, parent: str, flavour: _Flavour, limit: int) -> None:
        self.flavour = flavour
        self.path = os.path.join(parent, f"stabledrl-{os.getpid()}-{next(_cgroup_names)}")
        self.oom_fd: int | None = None
        """v1: an eventfd the kernel signals at each OOM in the cgroup (v2 kills the group itself)."""
        self._fds: list[int] = []
        os.mkdir(self.path)
        try:
            for i, name in enumerate(flavour.limits):
                try:
                    _write(os.path.join(self.path, name), str(limit))
                except OSError:
                    if i == 0:
                        raise
            for name, value in flavour.settings:
                try:
                    _write(os.path.join(self.path, name), value)
                except OSError:
                    pass
            if flavour is _V1:
                efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                self._fds.append(efd)
                ofd = os.open(os.path.join(self.path, "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC)
                self._fds.append(ofd)
                _write(os.path.join(self.path, "cgroup.event_control"), f"{efd} {ofd}")
                self.oom_fd = efd
        except BaseException:
            self.remove()
            raise

    def oom_kills(self) -> int:
        try:
            with open(os.path.join(self.path, self.flavour.events)) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        """Kill whatever is left in it (nothing, normally: the PID namespace is gone) and remove it."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for _ in range(200):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY: processes still in it
                try:
                    with open(os.path.join(self.path, "cgroup.procs")) as f:
                        for pid in f.read().split():
                            os.kill(int(pid), 9)  # SIGKILL
                except (OSError, ValueError):
                    pass
                time.sleep(0.005)
        logger.warning("could not remove the sandbox's memory cgroup %s", self.path)


def _memory_cgroup(memory_mb: float) -> _MemoryCgroup | None:
    """A new cgroup for one program, or None where we cannot make one (then the monitor bounds it)."""
    global _cgroup_parent
    if not _USE_CGROUPS:
        return None
    with _cgroup_lock:
        if _cgroup_parent is False:
            _cgroup_parent = _find_cgroup_parent()
            if _cgroup_parent is None:
                logger.info("no memory cgroup can be made here: the sandbox's memory monitor bounds programs")
        parent = _cgroup_parent
    if not parent:
        return None
    try:
        return _MemoryCgroup(*parent, limit=int(memory_mb * (1 << 20)))
    except OSError as e:
        logger.warning("could not make a memory cgroup (%s): the monitor bounds this program", e)
        return None


# (text, reason, also anywhere in stderr): the final error line is matched first; the
# whole of stderr only for the limits and refusals, whose tracebacks may come from any of
# several processes and end up interleaved.
_STDERR_REASONS = (
    ("stabledrl sandbox: network refused", "network refused", True),
    ("stabledrl sandbox: write refused", "write refused", True),
    ("SyntaxError", "syntax error", False),
    ("IndentationError", "syntax error", False),
    ("TabError", "syntax error", False),
    ("MemoryError", "memory", True),
    ("[Errno 12]", "memory", False),  # ENOMEM
    ("BlockingIOError: [Errno 11]", "process limit", True),  # EAGAIN from fork
    ("can't start new thread", "process limit", True),
    ("[Errno 101]", "network refused", False),  # ENETUNREACH: nothing is routable in the namespace
    ("[Errno 99]", "network refused", False),  # EADDRNOTAVAIL
    ("[Errno 30]", "write refused", False),  # EROFS
    ("[Errno 27]", "file size", False),  # EFBIG
    ("AssertionError", "assertion failed", False),
)
_SIGNAL_REASONS = {24: "cpu time", 25: "file size"}  # SIGXCPU, SIGXFSZ


def _reason(returncode: int | None, stderr: str) -> str:
    if returncode == 0:
        # A thread or child process died of MemoryError (or ENOMEM) and the main thread went
        # on to exit 0: the program hit its memory bound all the same.
        for line in stderr.splitlines():
            if line.startswith("MemoryError") or (": [Errno 12]" in line and not line[:1].isspace()):
                return "memory"  # the last line of a traceback: MemoryError, or ENOMEM from mmap, fork ...
        return "ok"
    if returncode is not None and returncode < 0:
        return _SIGNAL_REASONS.get(-returncode, f"killed by signal {-returncode}")
    lines = [line for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    for needle, reason, _ in _STDERR_REASONS:
        if needle in last:
            return reason
    for needle, reason, anywhere in _STDERR_REASONS:
        if anywhere and needle in stderr:
            return reason
    return "nonzero exit"


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use (docs/methods.md, "Code sandbox")."""

    timeout_s: float = 5.0
    """Wall time for the whole run, after which every process is killed."""
    memory_mb: float = 512
    """Memory of the whole program, all its processes and threads together (layer 6), and the
    address-space limit of each process (RLIMIT_AS)."""
    cpu_s: float | None = None
    """CPU-time limit of each process; None: ceil(timeout_s) + 1."""
    max_output_bytes: int = 1 << 20
    """stdout and stderr together; the program is killed beyond it."""
    max_processes: int = 16
    """Processes and threads of the program together (RLIMIT_NPROC)."""
    max_file_mb: float = 16
    """Largest file the program may write."""
    disk_mb: float = 64
    """Size of the program's directory (its tmpfs)."""
    max_open_files: int = 256
    """RLIMIT_NOFILE."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb <= 0 or self.max_output_bytes <= 0 or self.max_processes < 1:
            raise ValueError("timeout_s, memory_mb, max_output_bytes and max_processes must be positive")


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, site_packages: bool = False,
               audit_hook: bool = True) -> SandboxResult:
    """Run `code` as the main module of a sandboxed Python within `limits` and report what
    happened. `site_packages`: let the program import installed packages (drops ``-S``).
    `audit_hook`: install the audit-hook layer (off only to test the OS layers alone)."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    t0 = time.perf_counter()
    root = os.geteuid() == 0
    uid = _UIDS.take() if root else os.geteuid()
    gid = uid if root else os.getegid()
    home = tempfile.mkdtemp(prefix="stabledrl-sandbox-")
    try:
        return _run_in(home, code, (uid, gid), limits, ["-I", "-B"] + ([] if site_packages else ["-S"]),
                       audit_hook, t0)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        if root:
            _UIDS.give(uid)


def _run_in(home: str, code: str, ids: tuple[int, int], limits: SandboxLimits, flags: list[str], audit_hook: bool,
            t0: float) -> SandboxResult:
    """`run_python` in the program's directory `home` as (uid, gid) `ids`, with the
    interpreter's `flags`; every process and the memory cgroup are gone when it returns."""
    cpu_s = math.ceil(limits.timeout_s) + 1 if limits.cpu_s is None else limits.cpu_s
    # Pipes as unbuffered file objects: closing one twice is harmless, unlike os.close.
    info_r, info_w = (os.fdopen(fd, mode, buffering=0) for fd, mode in zip(os.pipe(), ("rb", "wb")))
    ctl_r, ctl_w = (os.fdopen(fd, mode, buffering=0) for fd, mode in zip(os.pipe(), ("rb", "wb")))
    proc = cgroup = None
    try:
        with open(os.path.join(home, "main.py"), "wb") as f:
            f.write(code.encode("utf-8", errors="replace"))  # lone surrogates cannot be encoded
        cgroup = _memory_cgroup(limits.memory_mb)
        join = os.path.join(cgroup.path, cgroup.flavour.join) if cgroup else ""  # the file to move in with
        args = [home, *ids, info_w.fileno(), ctl_r.fileno(), limits.memory_mb, cpu_s, limits.max_file_mb,
                limits.max_processes, limits.max_open_files, limits.disk_mb, int(audit_hook), join]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(
            [sys.executable, *flags, _BOOT, *map(str, args)], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=home, env=env, start_new_session=True,
            pass_fds=(info_w.fileno(), ctl_r.fileno()))
        info_w.close()
        ctl_r.close()
        out, err, info, killed_for = _collect(proc, info_r, ctl_w, t0 + limits.timeout_s, limits.max_output_bytes,
                                              cgroup.oom_fd if cgroup else None)
    except OSError as e:  # could not start the sandbox at all
        logger.error("sandbox failed to start: %s", e)
        return SandboxResult(False, None, "sandbox error", "", str(e), time.perf_counter() - t0)
    finally:
        for f in (info_r, info_w, ctl_r, ctl_w):
            f.close()
        if proc is not None:
            _reap(proc)
        over_memory = cgroup is not None and cgroup.oom_kills() > 0
        if cgroup is not None:
            cgroup.remove()
    return _verdict(info, out, err, killed_for, over_memory, time.perf_counter() - t0)


def _verdict(info: list[str], out: bytes, err: bytes, killed_for: str | None, over_memory: bool,
             seconds: float) -> SandboxResult:
    """The result from what the bootstrap reported (its info lines) and what the parent saw."""
    said = dict(line.split(" ", 1) for line in info if " " in line)  # {"pid": ..., "layers": ..., ...}
    status = int(said["program-status"]) if "program-status" in said else int(said.get("status", "-1"))
    status = None if status < 0 else status
    layers = ["process-group"] + said.get("layers", "").split(",")
    returncode = None if status is None else os.waitstatus_to_exitcode(status)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if over_memory or "memory" in said:  # the cgroup's OOM killer or the monitor stopped it
        reason = "memory"
    elif killed_for:
        reason = killed_for
    elif status is None:
        reason = "sandbox error"
        logger.error("the sandbox bootstrap failed: %s", stderr[-2000:])
    else:
        reason = _reason(returncode, stderr)
    return SandboxResult(reason == "ok", returncode, reason, stdout, stderr, seconds,
                         tuple(layer for layer in _ALL_LAYERS if layer in layers))


def _collect(proc: subprocess.Popen, info: io.RawIOBase, ctl: io.RawIOBase, deadline: float,
             cap: int, oom_fd: int | None) -> tuple[bytes, bytes, list[str], str | None]:
    """Read stdout, stderr and the info pipe until the bootstrap exits, the deadline
    passes, the output exceeds `cap` or `oom_fd` (the memory cgroup's OOM eventfd) fires;
    close `ctl` (kill) in every case."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err, inf = proc.stdout.fileno(), proc.stderr.fileno(), info.fileno()
    bufs = {out: bytearray(), err: bytearray(), inf: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    if oom_fd is not None:
        sel.register(oom_fd, selectors.EVENT_READ)
    reading = set(bufs)
    killed_for = None
    grace_until = None  # after the bootstrap exits, stray writers get a moment, not the deadline
    try:
        while reading:
            now = time.perf_counter()
            if now >= deadline:
                killed_for = "timeout"
                break
            if grace_until is not None and now >= grace_until:
                break
            for key, _ in sel.select(timeout=min(deadline, grace_until or deadline) - now):
                if key.fd == oom_fd:  # the kernel killed a process at the bound: stop the rest now
                    killed_for = "memory"
                    break
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    reading.discard(key.fd)
                    if key.fd == inf:
                        grace_until = time.perf_counter() + 0.2
                bufs[key.fd] += chunk
            if killed_for:
                break
            if len(bufs[out]) + len(bufs[err]) > cap:
                killed_for = "output cap"
                break
    finally:
        sel.close()
        ctl.close()  # EOF: the bootstrap kills everything (a no-op if it has exited)
    if killed_for:  # let the bootstrap finish: its last words are the status after the kill
        _wait_exited(proc, _BOOTSTRAP_EXIT_S)
    # What is still in the pipes: all of it, once the bootstrap has exited (every process of a
    # PID namespace is gone by then), however late this thread got to run after the EOF.
    for fd in (inf, out, err):
        try:
            while (fd == inf or len(bufs[out]) + len(bufs[err]) <= cap) and (chunk := os.read(fd, 65536)):
                bufs[fd] += chunk
        except BlockingIOError:
            pass
    stdout = bytes(bufs[out][:cap])
    stderr = bytes(bufs[err][: cap - len(stdout)])
    return stdout, stderr, bytes(bufs[inf]).decode(errors="replace").splitlines(), killed_for


# How long the bootstrap may take to exit once told to: it kills the namespace's init and
# reaps it, which waits for the kernel to tear the namespace down (seconds for a program
# the OOM killer stopped with hundreds of MB, on a loaded machine). Killed before that, it
# would orphan init to the host's PID 1, a zombie of the sandbox's uid until that reaps it.
_BOOTSTRAP_EXIT_S = 10.0


def _wait_exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to `timeout` for the bootstrap to exit, without reaping it (WNOWAIT): while
    it is an unreaped zombie its pid, and so its process-group id, cannot be reused."""
    end = time.perf_counter() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:
            return True
        if time.perf_counter() >= end:
            return False
        time.sleep(0.002)


def _reap(proc: subprocess.Popen) -> None:
    """Kill whatever is left of the bootstrap's process group (nothing, with a PID
    namespace; the bootstrap too if it lingers), then reap the bootstrap."""
    _wait_exited(proc, _BOOTSTRAP_EXIT_S)
    try:
        os.killpg(proc.pid, 9)  # SIGKILL
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()
