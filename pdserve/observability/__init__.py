"""Observability shared by every pdserve process: Prometheus metric definitions (router
request latencies, worker engine and KV state), the `/metrics` HTTP endpoint of the workers,
the gRPC interceptor that logs and counts worker requests, and structured JSON logs.

Nothing here is process-global: each process builds its own `CollectorRegistry` and passes it
to whoever serves it (the router's aiohttp app, the worker's metrics HTTP server).
"""
