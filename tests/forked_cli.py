"""fairseq's command lines as real processes, without paying Python's and torch's start-up for each.

A CLI test on the tiny models spends most of its time importing torch and fairseq (seconds),
not decoding (a fraction of one). A server process imports them once; each command is then a
child forked from it that runs ``python -m MODULE ARGS`` as the interpreter would: its own
stdin, stdout and stderr (file descriptors 0-2, so fairseq's logging and any print land where
they would), its own environment and working directory, ``sys.argv`` as ``-m`` sets it, an
uncaught exception through ``sys.excepthook`` (the plugin's one-line errors), ``SystemExit``
and exit statuses as Python gives them, the ``atexit`` handlers run at the end. The plugin is
not imported before the fork: whatever it decides at import time, it decides in the child.

Only variables read when torch starts (threads, instruction sets) cannot differ from one child
to the next: a server is kept per value of those (:data:`START_VARIABLES`).
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

# read by torch, MKL, oneDNN or Python itself when the server starts; anything else is read by
# the child (the plugin's own variables included)
START_VARIABLES = ("OMP_", "MKL_", "ONEDNN_", "DNNL_", "ATEN_", "KMP_", "GOMP_", "PYTHON",
                   "LD_", "CUDA_", "TORCH_")

_SERVER = r'''
import atexit, importlib.util, json, os, runpy, signal, sys

requests, replies = (int(fd) for fd in sys.argv[1:3])
for fd in (requests, replies):
    os.set_inheritable(fd, False)  # not into what a command executes (distributed ranks)
import torch  # noqa: F401  (the start-up this server exists to pay once)
import fairseq  # noqa: F401


def child(request):
    os.close(requests)
    os.close(replies)
    for fd, path, mode in ((0, request["stdin"], os.O_RDONLY),
                           (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                           (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # as `python -m`: argv[0] is "-m" while the module's packages import, then the module's file
    sys.argv = ["-m"] + request["args"]
    spec = importlib.util.find_spec(request["module"])
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        spec = importlib.util.find_spec(request["module"] + ".__main__")
    sys.argv[0] = spec.origin
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:  # as the interpreter reads it
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            sys.stderr.write("%s\n" % (stop.code,))
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
        if isinstance(sys.exc_info()[1], KeyboardInterrupt):
            code = -signal.SIGINT  # Python ends as killed by the SIGINT it got
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


with os.fdopen(requests, "r") as incoming, os.fdopen(replies, "w") as outgoing:
    for line in incoming:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(request)
        outgoing.write("%d\n" % pid)
        outgoing.flush()
        _, status = os.waitpid(pid, 0)
        outgoing.write("%d\n" % os.waitstatus_to_exitcode(status))
        outgoing.flush()
'''


class _Server:
    def __init__(self, env):
        requests_read, self._requests = os.pipe()
        self._replies, replies_write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(requests_read), str(replies_write)],
            pass_fds=(requests_read, replies_write), env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(requests_read)
        os.close(replies_write)
        self._buffer = b""

    def _reply(self, timeout):
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._replies], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self._replies, 4096)
            if not chunk:
                raise RuntimeError("the CLI server ended (status %s)" % self.process.poll())
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return int(line)

    def run(self, request, timeout):
        os.write(self._requests, (json.dumps(request) + "\n").encode())
        pid = self._reply(timeout)
        code = self._reply(timeout)
        if code is None:
            os.kill(pid, signal.SIGKILL)
            self._reply(None)
            raise subprocess.TimeoutExpired(request["module"], timeout)
        return code

    def close(self):
        os.close(self._requests)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.close(self._replies)


_servers = {}
_lock = threading.Lock()


def _start_key(env):
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(START_VARIABLES)))


@atexit.register
def _close_servers():
    while _servers:
        _servers.popitem()[1].close()


def run_module(module, args, env, input_text=None, cwd=None, timeout=600):
    """``python -m module *args`` with ``env``: a CompletedProcess with text stdout and stderr."""
    args = [str(a) for a in args]
    with _lock, tempfile.TemporaryDirectory(prefix="forked-cli-") as folder:
        paths = {name: os.path.join(folder, name) for name in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "w", encoding="utf-8") as f:
            f.write(input_text or "")
        for name in ("stdout", "stderr"):
            open(paths[name], "w").close()
        key = _start_key(env)
        if key in _servers and _servers[key].process.poll() is not None:
            del _servers[key]  # ended (killed from outside): start another
        if key not in _servers:
            _servers[key] = _Server(env)
        request = dict(paths, module=module, args=args, env=dict(env), cwd=cwd or os.getcwd())
        code = _servers[key].run(request, timeout)
        with open(paths["stdout"], encoding="utf-8", errors="replace") as out, \
                open(paths["stderr"], encoding="utf-8", errors="replace") as err:
            return subprocess.CompletedProcess([sys.executable, "-m", module] + args, code,
                                               out.read(), err.read())
