"""The engine workers: processes' engines on the bus. They take requests off a bus port, run
them on an AsyncEngine and put token events back; they know nothing of the command line.

- engine_worker.py: EngineWorker, the whole request life on one engine (`kvserve serve`'s
  worker, and the base of the other two).
- prefill.py: PrefillWorker, which computes a prompt into the prefix store and forwards the
  request to the decode stream (disaggregated topology).
- decode.py: DecodeWorker, an EngineWorker that loads the prefilled tail from the store first.
- token_events.py: RequestOutputs to numbered token events; admin_jobs.py: warm-up and flush
  jobs; spans.py: the spans every worker records; metrics.py: a worker's Prometheus endpoint.

Modules are imported by their full names (nothing is re-exported here), so that importing one
worker does not import the others.
"""
