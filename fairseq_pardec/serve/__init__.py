"""``fairseq-pardec-serve``: the plugin's generators behind HTTP, one process per replica.

One job per module:

* ``options``: the command line, fairseq-interactive's parser with a group of our own;
* ``model``: the checkpoint, task, generator, and text in and out exactly as fairseq-interactive
  encodes and decodes it;
* ``running_batch``: the interface the batcher decodes through (rows join, step, leave), and its
  per-round implementation;
* ``batcher``: the one thread that decodes, its queue of rows, and when rows join (at once, or
  gathered into a buffer);
* ``limits``: what a request may ask, and the HTTP error each limit answers with;
* ``metrics``: the Prometheus metrics;
* ``edits``: the word edits between a text and its output (the page highlights them);
* ``page``: the try-it page at ``/``;
* ``app``: the ASGI app (FastAPI): the endpoints;
* ``server``: uvicorn on a socket of our own, draining on SIGTERM.
"""
