"""Scale-out on Ray: the same engine and routes behind Ray Serve (online) and Ray Data (offline batch).

Only ``serve_app`` and ``ray_batch`` import ray (the ``.[ray]`` extra); everything else here is plain
Python that the base install can import and test:

    settings.py      ServeSettings: what a Serve deployment is made of -> deployment options (pure)
    tenants.py       API keys -> tenants; per-tenant rate, concurrency and queue caps (ASGI middleware)
    recycling.py     when a replica asks to be replaced (requests served, RSS, CUDA memory)
    memory.py        per-replica CUDA memory cap and the KV slots that fit inside it
    metrics_export.py  a replica's Prometheus series re-exported as Ray metrics (one series per replica)
    serve_app.py     the Serve deployment (FastAPI ingress = create_app's app) and ``app``, the builder
    jobs.py          batch inputs (txt, jsonl, parquet) -> items with ids and seeds; manifest; resume; shards
    offline.py       ``synthesize --input ... --devices a,b``: one process per device, no Ray
    ray_batch.py     ``chattts-serve ray batch``: Ray Data map_batches over an actor pool of engines

The engine never sees Ray: a replica runs the app ``server.app.create_app`` builds, and a batch actor runs
``Engine.synthesize``, exactly as one process does.
"""
