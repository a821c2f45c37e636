"""The P:D planner: engine cost profiles (``pdserve profile``), a discrete-event model of the PD pipeline, and
the search over splits of a GPU budget (``pdserve plan-split``).

- profile.py: the JSON profile (per-TP prefill, decode and KV-transfer costs) and its fitted cost models;
- measure.py: measuring a profile from running engines over HTTP;
- workload.py: arrivals and lengths (bench_serving's random dataset);
- simulate.py: the event loop, per-request TTFT/TPOT, goodput;
- search.py: candidate splits ranked by goodput per GPU;
- cli.py: ``pdserve plan-split``.
"""
