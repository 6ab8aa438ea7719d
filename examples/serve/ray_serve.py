"""fairseq-pardec-serve's app as replicas under Ray Serve, on this machine or a Ray cluster.

    pip install "ray[serve]"
    python examples/serve/ray_serve.py --replicas 2 --port 8000 -- \
        demo-out/data/bin --path demo-out/ckpt/checkpoint_last.pt --bpe subword_nmt \
        --bpe-codes demo-out/data/bpe/codes --remove-bpe --generator auto --cpu
    curl -s localhost:8000/translate -H 'Content-Type: application/json' -d '{"text": "..."}'

Everything after ``--`` is fairseq-pardec-serve's command line; each replica builds the same app
from it. Ray's proxy listens on --host/--port and spreads requests over the replicas.
"""

import argparse
import signal
import threading


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-cpus", type=int, default=None, help="a local Ray's CPUs")
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    server_args = options.server_args[1:] if options.server_args[:1] == ["--"] else options.server_args

    import ray
    from ray import serve

    from fairseq_pardec.serve.replicas import ray_app

    ray.init(num_cpus=options.num_cpus)
    serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(ray_app(server_args, replicas=options.replicas), route_prefix="/")
    print("fairseq-pardec-serve under Ray Serve: %d replicas at http://%s:%d/"
          % (options.replicas, options.host, options.port), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()


if __name__ == "__main__":
    main()
