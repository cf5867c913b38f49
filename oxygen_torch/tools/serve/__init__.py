"""``python -m oxygen_torch serve PATH``: an OpenAI-compatible HTTP server on the engine.

Each HTTP request is one ``generate()`` call on a worker thread, tagged with its priority and
seed through ``oxygen_torch.task``; with ``scheduler.engine`` on (the server's default) one
engine thread steps every request's rows at once. Modules, each one idea:

  protocol.py  the JSON a client sends, checked field by field (OpenAI's error objects)
  text.py      one choice's text: incremental detokenisation, stop strings, finish reason
  jobs.py      one request's generate() call on a worker thread, its tokens to the event loop;
               admission (at most ``max_queue`` requests waiting for their first token)
  app.py       the FastAPI app: the endpoints, server-sent events, limits, errors, metrics
  http.py      uvicorn with deadlines: a connection must send its headers in time
  command.py   the command line: load the checkpoint, enable oxygen, run the server

FastAPI and uvicorn come with the ``serve`` extra (``pip install "oxygen_torch[serve]"``); this
package imports them only when the server is built.
"""
