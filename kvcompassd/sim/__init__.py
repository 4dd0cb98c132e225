"""Event-driven simulator: virtual clock, WAN model, workloads, baselines and metrics.

The simulator replays requests through routing policies (KVCompass through the real core, plus
the paper's baselines) on a virtual clock, with workers modelled by the shared worker timing
model and prefix cache.
"""
