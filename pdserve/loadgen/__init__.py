"""pdserve's serving load generator (`pdserve bench`).

    datasets  -> Workload (token-id prompts: random | prefix | mixed)
    arrivals  -> send offsets (Poisson / gamma, or all at once)
    runner    -> sends through a Backend (grpc_backend | openai_backend), records arrivals
    records   -> RequestResult per request
    metrics   -> TTFT / TPOT / ITL / E2E, percentiles, SLOs, goodput (pure)
    report    -> JSON + table;  plots -> PNG (matplotlib, optional);  cli -> the flags

Import the submodules you need; this package imports nothing heavy on its own.
"""
