"""``python -m oxygen_torch serve PATH``: an OpenAI-compatible HTTP server on the engine.

Each HTTP request is one ``generate()`` call, tagged with its priority and seed through
``oxygen_torch.task``, run in the engine process (a process of its own: the HTTP side's Python
does not share the model's interpreter lock) or, with ``--one-process``, on a worker thread of
the server's; with ``scheduler.engine`` on (the server's default) one engine thread steps every
request's rows at once. Modules, each one idea:

  protocol.py        the JSON a client sends, checked field by field (OpenAI's error objects)
  text.py            one choice's text: incremental detokenisation, stop strings, finish reason
  jobs.py            one request's side of its call, its text to the event loop; admission (at
                     most ``max_queue`` requests waiting for their first token); ThreadRunner
  engine_process.py  the engine process and the pipe to it (EngineProcess: the runner)
  served.py          prompts to ids, the limits a request must fit, the call it becomes
  app.py             the FastAPI app: the endpoints, server-sent events, limits, errors, metrics
  http.py            uvicorn with deadlines: a connection must send its headers in time
  loading.py         the model's side: the configuration, the checkpoint, the warm-up call
  command.py         the command line: start the engine, run the server

FastAPI and uvicorn come with the ``serve`` extra (``pip install "oxygen_torch[serve]"``); this
package imports them only when the server is built.
"""
