"""The ASGI app: ``POST /translate``, ``GET /health``, ``/ready``, ``/metrics`` and the page.

Handlers never decode: they check the request at the door (serve/limits.py), encode its texts as
fairseq-interactive does, hand the rows to the batcher and wait on the request's future, its
deadline and the client's connection, whichever ends first. Each request gets one answer: the
outputs, or one JSON error.
"""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from fairseq_pardec.serve import limits as refusals
from fairseq_pardec.serve.batcher import Batcher, QueueFull, Stopping
from fairseq_pardec.serve.edits import word_edits
from fairseq_pardec.serve.limits import Limits, Refused, TranslateBody
from fairseq_pardec.serve.metrics import CONTENT_TYPE, Metrics
from fairseq_pardec.serve.running_batch import Row

logger = logging.getLogger("fairseq_pardec.serve")

# the status logged for a client that went away before its answer (nginx's convention); it
# never reaches the client
CLIENT_GONE = 499


@dataclass
class Service:
    """What a replica serves with: the loaded model, its batcher, limits, metrics, the page."""

    model: object  # serve.model.LoadedModel
    batcher: Batcher
    limits: Limits
    metrics: Metrics
    page: str
    in_flight: int = 0  # /translate handlers not yet answered
    on_ready: list = field(default_factory=list)  # called once the batcher runs

    def ready(self) -> bool:
        return self.batcher.alive() and not self.batcher.draining

    def idle(self) -> bool:
        return self.in_flight == 0 and self.batcher.pending() == 0


def build_app(service: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.batcher.start()
        for callback in service.on_ready:
            callback()
        yield
        # the server has drained (server.py) or is stopping: requests still pending get 503
        await asyncio.get_running_loop().run_in_executor(None, service.batcher.stop)

    app = FastAPI(title="fairseq_pardec", lifespan=lifespan, docs_url="/docs", redoc_url=None)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        return HTMLResponse(service.page)

    @app.get("/health")
    async def health():
        """The process answers and its decoding thread runs."""
        alive = service.batcher.alive()
        return JSONResponse({"status": "ok" if alive else "decoding thread stopped"},
                            status_code=200 if alive else 503)

    @app.get("/ready")
    async def ready():
        """The model is loaded and warmed, and the replica takes requests (not draining)."""
        if service.ready():
            return JSONResponse({"status": "ready"})
        why = "draining" if service.batcher.draining else "not started"
        return JSONResponse({"status": why}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.post("/translate", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": TranslateBody.model_json_schema()}}}})
    async def translate(request: Request):
        """Decode one text or a list; the outputs come back in order."""
        arrived = time.perf_counter()
        service.in_flight += 1
        try:
            answer = await _translate(service, request, arrived)
        except Refused as refused:
            service.metrics.answered(refused.status)
            return JSONResponse(refused.body(), status_code=refused.status, headers=refused.headers)
        except _ClientGone:
            service.metrics.answered(CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        finally:
            service.in_flight -= 1
        service.metrics.answered(200, time.perf_counter() - arrived)
        return JSONResponse(answer)

    return app


class _ClientGone(Exception):
    pass


async def _read_body(request: Request, limit: int, limits: Limits) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise limits.body_too_large(int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise limits.body_too_large(-1)
        chunks.append(chunk)
    return b"".join(chunks)


async def _client_gone(request: Request):
    """Returns once the client has closed its connection (the body is read by then, so the
    server's next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # not expected after the body; never spin


async def _translate(service: Service, request: Request, arrived: float) -> dict:
    limits, model, batcher = service.limits, service.model, service.batcher
    if batcher.draining:
        raise refusals.draining()
    body = limits.parse(await _read_body(request, limits.max_request_bytes, limits))
    texts = limits.texts(body)
    single = isinstance(body.text, str)
    rows = []
    for i, text in enumerate(texts):
        source = model.encode(text)
        if model.too_long(source):
            raise limits.too_long(i, len(source), single)
        rows.append(Row(source=source, job=None, index=i))
    timeout_s = limits.timeout_s(body)
    try:
        job = batcher.submit(rows, timeout_s)
    except QueueFull as error:
        raise refusals.queue_full(error) from None
    except Stopping:
        raise refusals.draining() from None
    decoded = asyncio.wrap_future(job.future)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait({decoded, gone}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not decoded.done():
            batcher.cancel(job)  # its rows leave: the client went away, or the deadline passed
            decoded.cancel()
    if decoded in done:
        error = decoded.exception()
        if isinstance(error, Stopping):
            raise refusals.draining() from None
        if error is not None:
            logger.error("request failed: %s", error)
            raise Refused(500, "decoding failed: %s" % error) from None
        return _answer(model, body, texts, job, arrived)
    if gone in done:
        raise _ClientGone()
    raise refusals.deadline(timeout_s, body.timeout_ms is not None)


def _answer(model, body: TranslateBody, texts, job, arrived: float) -> dict:
    outputs = [model.output(row.source, row.hypotheses[0]) for row in job.rows]
    answer = {"outputs": [o.text for o in outputs]}
    if body.return_tokens:
        answer["tokens"] = [o.tokens for o in outputs]
    if body.return_score:
        answer["scores"] = [o.score for o in outputs]
        answer["positional_scores"] = [o.positional_scores for o in outputs]
    if body.return_edits:
        answer["edits"] = [word_edits(text, o.text) for text, o in zip(texts, outputs)]
    if body.return_timing:
        joined = min(row.joined_at for row in job.rows)
        finished = max(row.finished_at for row in job.rows)
        answer["timing"] = {"queue_ms": 1000 * (joined - job.submitted_at),
                            "decode_ms": 1000 * (finished - joined),
                            "total_ms": 1000 * (time.perf_counter() - arrived)}
    return answer
