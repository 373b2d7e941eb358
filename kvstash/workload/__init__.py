"""Workloads and what serving them measured, shared by the trace replayer
(bench/replay, against a running stack) and the simulator (kvstash.sim):
traces (Mooncake's format, or synthetic), the prompts their hash ids stand
for, and per-request records with their summary under SLOs."""
