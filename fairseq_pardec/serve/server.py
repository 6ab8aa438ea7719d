"""uvicorn for one replica: a socket of our own (``--port 0`` picks a free one and the ready line
names it), and a drain on SIGTERM instead of uvicorn's immediate shutdown.

On the first SIGTERM (or Ctrl-C) the replica stops taking work: new requests and ``/ready`` get
503 while the listening socket stays open, so that a load balancer sees it leave rather than
refused connections. Once every accepted request has been answered (or ``--drain-timeout``
has passed, when those left get 503) uvicorn shuts down and the process exits 0. A second signal
ends the drain at once.
"""

import errno
import logging
import signal
import socket
import sys
import time

import uvicorn

from fairseq_pardec.errors import UsageError
from fairseq_pardec.serve.app import Service, build_app

logger = logging.getLogger("fairseq_pardec.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config, service: Service, drain_timeout_s: float):
        super().__init__(config)
        self.service = service
        self.drain_timeout_s = drain_timeout_s
        self.drain_started = None

    def handle_exit(self, sig, frame):
        # not recorded as uvicorn records it: uvicorn raises a recorded signal again once it
        # has shut down, and the process would die of SIGTERM instead of exiting 0
        if self.drain_started is None:
            self.drain_started = time.monotonic()
            self.service.batcher.begin_drain()
            logger.info("%s: draining (%d texts pending, %d requests in flight)",
                        signal.Signals(sig).name, self.service.batcher.pending(),
                        self.service.in_flight)
        else:
            logger.info("%s again: ending the drain now", signal.Signals(sig).name)
            self.service.batcher.stop(timeout=0)
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            if self.service.idle():
                self.should_exit = True
            elif time.monotonic() - self.drain_started > self.drain_timeout_s:
                logger.warning("--drain-timeout %.0f s passed with %d texts pending: they get 503",
                               self.drain_timeout_s, self.service.batcher.pending())
                # the handlers still waiting answer 503 (Stopping) before uvicorn's shutdown
                # waits for them
                self.service.batcher.stop(timeout=1.0)
                self.should_exit = True
        return await super().on_tick(counter)


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        hint = ("another process listens there; give another --port (0: any free one)"
                if error.errno == errno.EADDRINUSE else "check --host and --port")
        raise UsageError("cannot listen on %s:%d (%s); %s" % (host, port, error.strerror, hint)) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return "http://%s:%d/" % ("[%s]" % host if ":" in host else host, port)


def serve(service: Service, host: str, port: int, drain_timeout_s: float, log_level: str = "info"):
    """Serve until drained; returns when the process may exit 0."""
    sock = listen(host, port)
    address = url(sock)
    # one line that says the replica takes requests, and where (scripts and tests wait for it)
    service.on_ready.append(lambda: print("fairseq-pardec-serve: ready at %s" % address,
                                          file=sys.stderr, flush=True))
    config = uvicorn.Config(build_app(service), log_level=log_level, access_log=False,
                            lifespan="on", timeout_keep_alive=30)
    DrainingServer(config, service, drain_timeout_s).run(sockets=[sock])
