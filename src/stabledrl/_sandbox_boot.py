"""The sandbox's bootstrap: the program that `stabledrl.sandbox.run_python` starts, by path,
in a fresh interpreter (``python -I -B [-S] _sandbox_boot.py ARGS``), as root if we are root.

It sets up the namespaces and mounts, then forks the namespace's init (PID 1 of the new
PID namespace), which limits and de-privileges itself and forks the program; the program
installs the audit hook and runs main.py. init reaps orphans and reports the program's
status; the bootstrap reaps init. The layers are described in `stabledrl.sandbox`'s
docstring; this module carries them out.

Standard library only, and only what it needs (ctypes, os, resource, select, sys, types):
it runs once per program, and importing `stabledrl.sandbox`'s own dependencies
(subprocess, dataclasses, logging ...) would cost ~25 ms each time. Importing it does
nothing but define things (tests read its helpers); it acts only when run as a script.

Protocol: argv carries the settings (`Settings`); the info pipe receives "pid N" (init's
pid), "layers a,b", "memory over" (the monitor killed the program), "program-status S"
and "status S" (init's) lines; EOF on the control pipe means "kill everything now".
"""

import ctypes
import os
import resource
import select
import sys
import types

NEWNS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, NOATIME, NODIRATIME, BIND, REC, PRIVATE, RELATIME, STRICTATIME = (
    1, 2, 4, 8, 32, 1024, 2048, 4096, 16384, 1 << 18, 1 << 21, 1 << 24)
KEEP = {"nosuid": NOSUID, "nodev": NODEV, "noexec": NOEXEC, "noatime": NOATIME, "nodiratime": NODIRATIME,
        "relatime": RELATIME, "strictatime": STRICTATIME}
"""Mount options a read-only remount repeats: a remount sets exactly the flags it names."""
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, SIGKILL = 1, 4, 36, 38, 9
M_ARENA_MAX = -8  # a mallopt parameter

MONITOR_S = 0.005
"""The memory monitor's polling interval."""

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)


class Settings:
    """What `run_python` passes on the command line, in this order: the program's directory;
    its uid and gid (the sandbox uid as root, else ours); the write end of the info pipe and
    the read end of the control pipe; memory_mb, cpu_s, max_file_mb, max_processes,
    max_open_files, disk_mb; 1 or 0 for the audit hook; the memory cgroup's file to join
    ("" for none)."""

    def __init__(self, argv: list[str]) -> None:
        (self.home, uid, gid, info, ctl, memory_mb, cpu_s, file_mb, nproc, nofile, disk_mb, audit,
         self.join) = argv
        self.uid, self.gid, self.info, self.ctl = int(uid), int(gid), int(info), int(ctl)
        self.memory_mb, self.cpu_s, self.file_mb, self.disk_mb = map(float, (memory_mb, cpu_s, file_mb, disk_mb))
        self.nproc, self.nofile, self.audit = int(nproc), int(nofile), bool(int(audit))
        self.root = os.geteuid() == 0
        self.main_py = os.path.join(self.home, "main.py")


def say(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str | None, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(libc.mount(_enc(source), _enc(target), _enc(fstype), flags, _enc(data)), f"mount {target}")


def _enc(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def open_cgroup(path: str) -> int | None:
    """Open the program's memory cgroup's "tasks" or "cgroup.procs" file (`path`) for init to
    join later, while this process may still open it (before the namespaces and the
    read-only remount); None, with a line on stderr, if we cannot."""
    try:
        return os.open(path, os.O_WRONLY)
    except OSError as e:
        sys.stderr.write(f"stabledrl sandbox: could not open the memory cgroup: {e}\n")
        return None


def join_cgroup(fd: int) -> bool:
    """Move ourselves (our only thread) into the cgroup whose file `fd` is, by writing "0";
    False, with a line on stderr, if we cannot."""
    try:
        os.write(fd, b"0")
        return True
    except OSError as e:
        sys.stderr.write(f"stabledrl sandbox: could not join the memory cgroup: {e}\n")
        return False
    finally:
        os.close(fd)


def blocked_dirs(paths: list[str]) -> dict[str, set[str]]:
    """{directory the sandbox uid cannot traverse: names below it that `paths` need}."""
    out: dict[str, set[str]] = {}
    for p in paths:
        cur = "/"
        for name in os.path.abspath(p).split("/")[1:]:
            try:
                mode = os.stat(cur).st_mode
            except OSError:
                break
            if not mode & 0o001:
                out.setdefault(cur, set()).add(name)
                break
            cur = os.path.join(cur, name)
    return out


def open_blocked_dirs(paths: list[str]) -> None:
    """Cover each blocking directory with a tmpfs holding only the needed entries."""
    for _ in range(16):  # a bound-back entry may itself hold a blocking directory
        blocked = blocked_dirs(paths)
        if not blocked:
            return
        for d, names in blocked.items():
            fds = {}
            for n in names:
                try:
                    fds[n] = os.open(os.path.join(d, n), os.O_PATH | os.O_NOFOLLOW)
                except OSError:
                    pass
            mount("tmpfs", d, "tmpfs", NOSUID | NODEV, "size=64k,nr_inodes=64,mode=0711")
            for n, fd in fds.items():
                target = os.path.join(d, n)
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.mkdir(target)
                else:
                    os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
                mount(f"/proc/self/fd/{fd}", target, None, BIND | REC)
                os.close(fd)
    raise OSError("could not open the interpreter's directories to the sandbox uid")


def remount_all_readonly() -> int:
    """Remount every mount of our namespace read-only and nosuid; how many could not be."""
    failed = 0
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        point = fields[4]
        for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
            point = point.replace(esc, ch)
        flags = REMOUNT | BIND | RDONLY | NOSUID
        for opt in fields[5].split(","):
            flags |= KEEP.get(opt, 0)
        try:
            mount(None, point, None, flags)
        except OSError:
            failed += 1
    return failed


def drop_capabilities() -> None:
    """Clear every capability set (those an unprivileged user namespace granted us)."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")


def set_limits(s: Settings, spaces: bool) -> None:
    mib = 1 << 20
    cpu = max(1, int(s.cpu_s))
    for res, soft, hard in ((resource.RLIMIT_AS, int(s.memory_mb * mib), int(s.memory_mb * mib)),
                            (resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_FSIZE, int(s.file_mb * mib), int(s.file_mb * mib)),
                            (resource.RLIMIT_NOFILE, s.nofile, s.nofile),
                            (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(res, (soft, hard))
    # The count is per real uid: ours alone in the namespace (or as the sandbox uid);
    # otherwise it includes all our other processes, so allow for those.
    limit = s.nproc + 1 + (0 if s.root or spaces else tasks_of(s.uid))  # + init
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))


def tasks_of(owner: int) -> int:
    """Processes and threads whose real uid is `owner`."""
    n = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                text = f.read()
        except OSError:
            continue
        if f"\nUid:\t{owner}\t" in text:
            n += int(text.split("\nThreads:\t", 1)[1].split("\n", 1)[0])
    return n


def tree_memory(uid: int, root: bool) -> int:
    """Bytes of anonymous and shared memory resident in the program's processes: RssAnon +
    RssShmem of each (kB in /proc/PID/status, readable even for an undumpable process).
    /proc is the PID namespace's (our own processes only) or, without one, the host's,
    where the sandbox uid picks out the program's. Pages shared between processes count
    once per process: the sum errs high."""
    me, mine, total = str(os.getpid()), f"\nUid:\t{uid}\t".encode(), 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                text = f.read()
        except OSError:
            continue
        if root and mine not in text:
            continue
        for key in (b"\nRssAnon:", b"\nRssShmem:"):
            at = text.find(key)
            if at >= 0:
                total += int(text[at + len(key):].split(None, 1)[0]) * 1024
    return total


def children() -> list[int]:
    """Our child processes (scanning /proc: the kernel's children list needs a config option)."""
    me, out = os.getpid(), []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                    out.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return out


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# audit event -> ((index of a path argument, index of its dir_fd argument or None), ...)
_PATH_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),), "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.mkfifo": ((0, 2),),
    "os.mknod": ((0, 3),), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
    "shutil.rmtree": ((0, 1),),
}
_NET_EVENTS = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
               "socket.gethostbyaddr", "socket.getnameinfo", "socket.sethostname"}
_SOCK_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}


def audit_hook(home: str) -> None:
    """Refuse network use and writes outside `home`: raise before the operation happens."""
    import _thread
    home = os.path.realpath(home)
    busy = set()

    def inside(path, dir_fd=None):
        if isinstance(path, int):
            return True  # an already open descriptor
        path = os.fsdecode(path)
        base = os.getcwd()
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):  # -1/AT_FDCWD: the cwd
            base = os.readlink(f"/proc/self/fd/{dir_fd}")
        full = os.path.realpath(os.path.join(base, path))
        return full == home or full.startswith(home + "/") or full == "/dev/null"

    def refuse(what, detail):
        raise PermissionError(f"stabledrl sandbox: {what} refused ({detail})")

    def hook(event, args):
        me = _thread.get_ident()
        if me in busy:
            return
        busy.add(me)
        try:
            if event == "open":
                path, mode, flags = args
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & _WRITE_FLAGS)
                if writing and not inside(path):
                    refuse("write", repr(path))
            elif event in _PATH_EVENTS:
                for i, j in _PATH_EVENTS[event]:
                    if not inside(args[i], None if j is None or j >= len(args) else args[j]):
                        refuse("write", f"{event} {args[i]!r}")
            elif event == "socket.__new__":
                if args[1] != 1:  # AF_UNIX
                    refuse("network", f"socket family {args[1]}")
            elif event in _SOCK_EVENTS:
                if getattr(args[0], "family", None) != 1:
                    refuse("network", event)
            elif event in _NET_EVENTS:
                refuse("network", event)
        except PermissionError:
            raise
        except Exception as e:  # cannot tell where it writes: refuse
            refuse("write", f"{event}: {type(e).__name__}")
        finally:
            busy.discard(me)

    sys.addaudithook(hook)


def enter_namespaces(s: Settings, source: bytes) -> tuple[bool, list[str]]:
    """New namespaces, read-only mounts and the program's tmpfs (holding a copy of main.py,
    `source`), as far as the kernel and our privileges allow. Whether the namespaces are
    there, and the layers in force."""
    layers: list[str] = []
    try:
        check(libc.unshare(NEWNS | NEWNET | NEWPID | NEWIPC | (0 if s.root else NEWUSER)), "unshare")
        spaces = True
    except OSError:
        spaces = False
    if spaces and not s.root:  # map our own ids to themselves; deny setgroups as the kernel requires
        for name, text in (("setgroups", "deny"), ("uid_map", f"{s.uid} {s.uid} 1"),
                           ("gid_map", f"{s.gid} {s.gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    tmpfs = False
    if spaces:
        layers += ["net-ns", "pid-ns", "ipc-ns", "mount-ns"]
        try:
            mount(None, "/", None, REC | PRIVATE)  # nothing we mount here reaches the host
            if s.root:
                open_blocked_dirs([p for p in sys.path if p] + [
                    s.home, sys.prefix, sys.base_prefix, os.path.dirname(sys.executable),
                    os.path.dirname(os.path.realpath(sys.executable))])
            if remount_all_readonly() == 0:
                layers.append("readonly-fs")
            size = f"size={max(1, int(s.disk_mb))}m,nr_inodes=4096,mode=0700"
            mount("tmpfs", s.home, "tmpfs", NOSUID | NODEV, size + (f",uid={s.uid},gid={s.gid}" if s.root else ""))
            tmpfs = True
            layers.append("private-tmpfs")
            os.chdir(s.home)  # the old cwd is the directory under the new mount
            fd = os.open(s.main_py, os.O_CREAT | os.O_WRONLY, 0o444)
            os.write(fd, source)
            os.close(fd)
        except OSError as e:  # carry on with the layers we have; the result lists them
            sys.stderr.write(f"stabledrl sandbox: mount set-up incomplete: {e}\n")
    if s.root and not tmpfs:
        os.chown(s.home, s.uid, s.gid)
        blocked = blocked_dirs([p for p in sys.path if p])
        if blocked:
            sys.stderr.write("stabledrl sandbox: without a mount namespace the sandbox uid cannot read this "
                             f"interpreter's files under {sorted(blocked)}\n")
    return spaces, layers


def supervise(s: Settings, init: int, spaces: bool) -> None:
    """The bootstrap after the fork: report init's pid, kill it on EOF of the control pipe,
    reap it (and, without a PID namespace, whatever escaped), report its status, exit."""
    say(s.info, f"pid {init}")
    ready, _, _ = select.select([os.pidfd_open(init), s.ctl], [], [])
    if s.ctl in ready:  # EOF: the parent asks (or died)
        os.kill(init, SIGKILL)  # not reaped yet (we are its only reaper), so the pid is still ours
    _, status = os.waitpid(init, 0)
    while not spaces:  # whatever escaped the process group: kill, reap, repeat until none is left
        for pid in children():
            try:
                os.kill(pid, SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    say(s.info, f"status {status}")
    os._exit(0)


def become_init(s: Settings, spaces: bool, cgroup: bool, earlier: list[str]) -> bool:
    """Limit and de-privilege this process (and so everything it forks), and report the
    layers in force (`earlier`, those of `enter_namespaces`, and these); whether init must
    watch the program's memory itself (the monitor)."""
    layers, proc_ns = [*earlier], False
    if spaces:
        try:
            mount("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC)  # shows only the sandbox's processes
            proc_ns = True
        except OSError:
            pass
    set_limits(s, spaces)
    layers.append("rlimits")
    # Without a cgroup, init watches the program's memory itself: it can tell the program's
    # processes from ours in its own PID namespace, or by the sandbox uid when we are root.
    monitor = not cgroup and (s.root or proc_ns)
    if cgroup:
        layers.append("memory-cgroup")
    elif monitor:
        layers.append("memory-monitor")
    if s.root:
        os.setgroups([])
        os.setresgid(s.gid, s.gid, s.gid)
        os.setresuid(s.uid, s.uid, s.uid)  # from root to a non-root uid: every capability is dropped
        layers.append("uid")
    elif spaces:
        drop_capabilities()
        layers.append("no-caps")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
    layers.append("no-new-privs")
    check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl")  # after setuid, which clears it
    if s.audit:
        layers.append("audit-hook")
    say(s.info, "layers " + ",".join(layers))
    os.close(s.ctl)
    # One malloc arena for all the program's threads (inherited through fork): glibc would
    # reserve 64 MB of address space for each thread's own, and under RLIMIT_AS a few threads
    # then fail to start ("can't start new thread": a process limit in name only).
    libc.mallopt(M_ARENA_MAX, 1)
    return monitor


def reap(s: Settings, program: int, monitor: bool) -> None:
    """init's loop: reap orphans until the program exits (with the monitor, look at its
    memory every `MONITOR_S` and kill everything past the bound), report its status, exit."""
    status, over, done = None, False, False
    pidfd = os.pidfd_open(program) if monitor else None
    limit = s.memory_mb * (1 << 20)
    while status is None and not done:
        if monitor:  # wake when the program exits, or after one interval to look at its memory
            select.select([pidfd], [], [], MONITOR_S)
            if not over and tree_memory(s.uid, s.root) > limit:
                over = True
                say(s.info, "memory over")
                os.kill(-1, SIGKILL)  # every process of the namespace (or of the sandbox uid) but init
        while True:  # reap what has exited; without the monitor, block until something has
            try:
                pid, st = os.waitpid(-1, os.WNOHANG if monitor else 0)
            except ChildProcessError:
                done = True
                break
            if pid == program:
                status = st
            if pid == 0 or status is not None or not monitor:
                break
    if status is not None:
        say(s.info, f"program-status {status}")
    os._exit(0)  # in a PID namespace, the kernel now kills whatever the program left running


def prepare_program(s: Settings) -> dict:
    """The program's process: last settings, the audit hook, and a fresh __main__ module for
    main.py, whose namespace this returns."""
    check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl")  # fork cleared it
    check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl")  # setuid cleared it; lets it read /proc/self
    os.close(s.info)
    os.chdir(s.home)
    if s.audit:
        audit_hook(s.home)
    sys.argv = [s.main_py]
    module = types.ModuleType("__main__")
    module.__file__ = s.main_py
    sys.modules["__main__"] = module
    return module.__dict__


def main(argv: list[str]) -> tuple[bytes, str, dict]:
    """Set up the sandbox and fork; returns only in the program's process: (main.py's source,
    its path, the namespace to run it in)."""
    s = Settings(argv)
    cgroup_fd = open_cgroup(s.join) if s.join else None
    with open(s.main_py, "rb") as f:
        source = f.read()
    spaces, layers = enter_namespaces(s, source)
    # Without a PID namespace, orphans of the program would go to the host's init (which may
    # never reap them); as a subreaper we get them, and kill them once init is gone.
    check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl")
    init = os.fork()
    if init:
        # The bootstrap stays out of the memory cgroup: its OOM kill takes the whole group
        # (memory.oom.group), and a bootstrap killed with it could not reap init, which would
        # then linger as a zombie of the host's PID 1.
        if cgroup_fd is not None:
            os.close(cgroup_fd)
        supervise(s, init, spaces)  # does not return
    # init joins first of all: everything it forks later is in the cgroup
    cgroup = join_cgroup(cgroup_fd) if cgroup_fd is not None else False
    # --- the namespace's init: PID 1 of the new PID namespace, unprivileged from here on ---
    # It reaps orphans and reports the program's status. The program is not PID 1 itself,
    # because the kernel shields PID 1 from its own namespace's signals: os.kill(os.getpid(),
    # SIGTERM) would be ignored.
    monitor = become_init(s, spaces, cgroup, layers)
    program = os.fork()
    if program:
        reap(s, program, monitor)  # does not return
    return source, s.main_py, prepare_program(s)


if __name__ == "__main__":
    # The program runs here, at the top level, so that its tracebacks and stack depth are as
    # under a plain interpreter but for this one frame.
    _source, _path, _namespace = main(sys.argv[1:])
    exec(compile(_source, _path, "exec"), _namespace)
