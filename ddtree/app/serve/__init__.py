"""`ddtree serve`: the models stay loaded behind the OpenAI API, and `generate` / `chat --server`
send their work there.

    protocol   the requests (pydantic models) and OpenAI's error shape
    engine     the loaded models, one generation at a time from a FIFO, the kept state between requests
    metrics    the Prometheus counters and histograms (/metrics)
    api        the FastAPI app: routes, streaming, the body limit, the key
    server     the command: checks, start-up, uvicorn, signals
    client     `generate --server` and `chat --server` (imports neither torch nor transformers)
"""
