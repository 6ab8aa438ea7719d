"""Variant (d) of the load benchmark: fairseq's hub behind HTTP, one request at a time, as users
serve a fairseq model today (the hub's ``translate`` in a web handler).

``python -m fairseq_pardec.benchmark.hub_server DATA --path CKPT [fairseq-pardec-serve's
options]``: the same command line and ``POST /translate`` (``{"text": [...]}`` in,
``{"outputs": [...]}`` out) as the server, answered by ``GeneratorHubInterface.translate(texts,
beam=1)``, fairseq's own greedy search (our task's ``--generator beam``), one request after
another.
"""

import asyncio
import contextlib
import logging
import sys
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def load_hub(args):
    """fairseq's hub interface over the checkpoint, as ``from_pretrained`` builds it."""
    from fairseq import checkpoint_utils, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.hub_utils import GeneratorHubInterface

    args.generator = "beam"  # fairseq's SequenceGenerator, unchanged
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    task.report_summary = False
    models, _ = checkpoint_utils.load_model_ensemble(utils.split_paths(cfg.common_eval.path), task=task)
    hub = GeneratorHubInterface(cfg, task, models)
    if not cfg.common.cpu and __import__("torch").cuda.is_available():
        hub.cuda()
    return hub


def build_app(hub, on_ready):
    lock = threading.Lock()  # one request at a time

    def translate(texts):
        with lock:
            return hub.translate(texts, beam=1)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        on_ready()
        yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/ready")
    async def ready():
        return {"status": "ready"}

    @app.post("/translate")
    async def post(request: Request):
        body = await request.json()
        texts = [body["text"]] if isinstance(body["text"], str) else body["text"]
        loop = asyncio.get_running_loop()
        return JSONResponse({"outputs": await loop.run_in_executor(None, translate, texts)})

    return app


def main(argv=None):
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from fairseq_pardec.serve.options import parse_args
    from fairseq_pardec.serve.server import listen, url

    args = parse_args(sys.argv[1:] if argv is None else argv)
    hub = load_hub(args)
    sock = listen(args.host, args.port)
    address = url(sock)
    ready = lambda: print("fairseq-pardec-serve: ready at %s" % address, file=sys.stderr, flush=True)
    config = uvicorn.Config(build_app(hub, ready), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
